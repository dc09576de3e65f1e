"""Per-arm medians over seeds of a bench averaging result.json: train s, full's time / this (per seed), loss / full, B/step.

Usage: python medians.py result.json"""
import json, statistics, sys
r = json.load(open(sys.argv[1]))
arms = r["arms"]
full = {(a["seed"], a["condition"]): a for a in arms if a["scheme"] == "full"}
rows = {}
for a in arms:
    f = full.get((a["seed"], a["condition"]))
    rows.setdefault((a["condition"], a["scheme"]), []).append((a["train_s"], f["train_s"] / a["train_s"], a["val_loss"] / f["val_loss"], a["averaging_bytes_per_step"], a["consensus_distance"], a["rounds_failed"], a["longest_stall_s"]))
def med(xs): return statistics.median(xs)
for (cond, scheme), v in rows.items():
    ts = [x[0] for x in v]; sp = [x[1] for x in v]; lr = [x[2] for x in v]
    print(f"{cond:7s} {scheme:18s} train {med(ts):5.1f} ({min(ts):.0f}-{max(ts):.0f})  speedup {med(sp):.2f} ({min(sp):.2f}-{max(sp):.2f})  loss/full {med(lr):.4f} ({min(lr):.4f}-{max(lr):.4f})  B/step {med([x[3] for x in v]):.3g}  consensus {med([x[4] or 0 for x in v]):.2g}  failed {[x[5] for x in v]} stall {med([x[6] for x in v]):.1f}")

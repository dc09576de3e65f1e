"""Where do the bursts after joins come from? The 200-step warm-up-by-steps row (lr 0.01, small, seed 0), first 65
steps, without the tracker, in variants. Usage: probe.py OUT VARIANT"""
import json, sys
from agora.bench.training import TrainingOptions, count_spikes
from agora.config import DENSE_RESIDUAL, load_manifest
from agora.lab.train_local import train_model

out, variant = sys.argv[1], sys.argv[2]
opts = TrainingOptions(preset="small", steps=200, seeds=(0,))
base = load_manifest("small")
m = base.with_overrides(**{"optimizer.name": "adamw", "optimizer.total_steps": 200, "seed": 0,
                           "optimizer.lr": base.optimizer.lr * 10})
warm = {"until": opts.warmup_until, "mode": "steps"}
if variant == "noramp":
    warm["ramp_steps"] = 1
if variant == "slowramp":
    warm["ramp_steps"] = 36
if variant == "stages33":
    m = m.with_overrides(**{"stages": [3, 3]})
if variant == "dense":
    m = m.with_overrides(**dict(DENSE_RESIDUAL))
if variant != "nowarm":
    m = m.with_overrides(**{"training.warmup_depth": warm})
summary, _ = train_model(m, 65, val_batches=opts.val_batches)
L = summary["train_loss"]
D = [r["depth"] for r in summary["history"]]
json.dump({"variant": variant, "train_loss": L, "depth": D}, open(out, "w"))
print(variant, "spikes", count_spikes(L), "max", round(max(L[15:]), 2), "joins",
      [i for i in range(1, len(D)) if D[i] != D[i - 1]])
print([round(x, 2) for x in L])

"""Per seed and row of a convergence run: tokens/s over the training window, CPU seconds of every process per 1k
tokens, and the DHT/p2pd share (from each row's summary.json cpu_window)."""
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1]); rows = sys.argv[2].split(",")
by = {r: [] for r in rows}
for seed_dir in sorted(out.glob("seed*")):
    line = [seed_dir.name]
    for r in rows:
        s = json.loads((seed_dir / r / "summary.json").read_text())
        w = s["cpu_window"]; k = w["by_kind"]
        tps = s["tokens"] / w["seconds"]
        cpu = w["total_s"] / s["tokens"] * 1000
        by[r].append((tps, cpu, k["dht"], k["p2pd"], k["main"]))
        line.append(f"{r}: {tps:.0f} tok/s, {cpu:.3f} cpu-s/1k tok, dht {k['dht']:.1f} p2pd {k['p2pd']:.1f} main {k['main']:.1f}")
    print(" | ".join(line))
base = rows[0]
for r in rows[1:]:
    tr = [a[0] / b[0] for a, b in zip(by[r], by[base])]
    cr = [a[1] / b[1] for a, b in zip(by[r], by[base])]
    dr = [a[2] / b[2] for a, b in zip(by[r], by[base])]
    print(f"{r}/{base}: tokens/s {statistics.median(tr):.3f} ({min(tr):.3f}-{max(tr):.3f}) {['%.3f' % x for x in tr]}; "
          f"cpu/token {statistics.median(cr):.3f} ({min(cr):.3f}-{max(cr):.3f}); dht cpu {statistics.median(dr):.3f} ({min(dr):.3f}-{max(dr):.3f})")

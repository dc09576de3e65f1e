"""Median (min-max) over the seeds of this folder's per-seed results: `python summary.py` (prints the table)."""
import json
import pathlib
import statistics

HERE = pathlib.Path(__file__).parent
runs = [json.loads((HERE / f"s{s}" / "result.json").read_text())["rows"] for s in range(3)]
print("| arm | train s, 4 Mbit/s | `full`'s time / this | val loss vs `full` | averaging B/step | consensus distance |")
print("|---|---|---|---|---|---|")
for key in runs[0]:
    cols = []
    for field, fmt in (("train_s", "{:.1f}"), ("full_time_over_this", "{:.2f}"), ("vs_full_loss", "{:.4f}"),
                       ("averaging_bytes_per_step", "{:.3g}"), ("consensus_distance", "{:.2g}")):
        v = [r[key][field] for r in runs]
        cols.append(f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})")
    print(f"| {key.split('/')[1]} | " + " | ".join(cols) + " |")

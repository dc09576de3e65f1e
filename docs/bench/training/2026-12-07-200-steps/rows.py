"""Curvature-section rows of ``agora bench training`` at 200 steps (one per process):
    PYTHONPATH=src python rows.py OUT FACTOR WARMUP"""
import json
import sys
from pathlib import Path

from agora.bench.training import TrainingOptions, run_curvature
from agora.config import load_manifest

out, factor, warmup = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
opts = TrainingOptions(preset="small", steps=200, seeds=(0,), sections=("curvature",))
row = run_curvature(load_manifest(opts.preset), factor, 0, opts, "" if warmup == "no" else warmup)
out.mkdir(parents=True, exist_ok=True)
(out / "result.json").write_text(json.dumps({"command": sys.argv, "options": opts.__dict__, "row": row}, indent=2,
                                            default=str))
print({k: row[k] for k in ("lr", "warmup", "val_loss", "spikes", "alarms", "held_steps", "all_blocks_at_step",
                           "tracker_share")})

"""One row of ``agora bench training``'s curvature section, on its own (a row re-run after a change to it):

    PYTHONPATH=src python docs/bench/training/one_row.py OUT FACTOR WARMUP [--residual dense] [--steps N]

FACTOR: multiple of the preset's learning rate; WARMUP: no, steps or curvature; N: optimizer steps (40; the 40-step
rows also measured the tracker's error with 40 more products at the end, longer rows do not). Writes
OUT/result.json.
"""

import json
import sys
from pathlib import Path

from agora.bench.training import TrainingOptions, run_curvature
from agora.config import DENSE_RESIDUAL, load_manifest

out, factor, warmup = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
dense = "--residual" in sys.argv and sys.argv[sys.argv.index("--residual") + 1] == "dense"
steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 40
opts = TrainingOptions(preset="small", steps=steps, seeds=(0,), sections=("curvature",),
                       curvature_reference_hvps=40 if steps == 40 else 0,
                       overrides=dict(DENSE_RESIDUAL) if dense else {})
row = run_curvature(load_manifest(opts.preset), factor, 0, opts, "" if warmup == "no" else warmup)
out.mkdir(parents=True, exist_ok=True)
(out / "result.json").write_text(json.dumps({"command": sys.argv, "options": opts.__dict__, "row": row}, indent=2,
                                            default=str))
print({k: row[k] for k in ("lr", "warmup", "val_loss", "spikes", "alarms", "held_steps", "all_blocks_at_step",
                           "tracker_share")})

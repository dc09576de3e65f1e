"""One row of ``agora bench training``'s curvature section, on its own (a row re-run after a change to it):

    PYTHONPATH=src python docs/bench/training/one_row.py OUT FACTOR WARMUP [--residual dense]

FACTOR: multiple of the preset's learning rate; WARMUP: no, steps or curvature. Writes OUT/result.json.
"""

import json
import sys
from pathlib import Path

from agora.bench.training import TrainingOptions, run_curvature
from agora.config import load_manifest

out, factor, warmup = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
dense = "--residual" in sys.argv and sys.argv[sys.argv.index("--residual") + 1] == "dense"
opts = TrainingOptions(preset="small", steps=40, seeds=(0,), sections=("curvature",), curvature_reference_hvps=40,
                       overrides={"residual.mode": "dense", "residual.k": None, "residual.wire_dtype": "fp32"}
                       if dense else {})
row = run_curvature(load_manifest(opts.preset), factor, 0, opts, "" if warmup == "no" else warmup)
out.mkdir(parents=True, exist_ok=True)
(out / "result.json").write_text(json.dumps({"command": sys.argv, "options": opts.__dict__, "row": row}, indent=2,
                                            default=str))
print({k: row[k] for k in ("lr", "warmup", "val_loss", "spikes", "alarms", "held_steps", "all_blocks_at_step",
                           "tracker_share")})

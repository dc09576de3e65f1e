"""Architecture warm-up with other ramp lengths: PYTHONPATH=src python docs/bench/training/ramp_variants.py RAMP:UNTIL ..."""
import sys, json
from agora.config import load_manifest
from agora.lab.train_local import train_model
from agora.bench.training import count_spikes
base = load_manifest("small")
for ramp, until in [(int(a.split(":")[0]), float(a.split(":")[1])) for a in sys.argv[1:]]:
    m = base.with_overrides(**{"optimizer.total_steps": 40, "seed": 0, "optimizer.lr": 0.01,
                               "training.warmup_depth": {"until": until, "ramp_steps": ramp}})
    s, _ = train_model(m, 40, val_batches=8)
    print(ramp, until, "val", round(s["val_loss"], 4), "spikes", count_spikes(s["train_loss"]), [round(x, 2) for x in s["train_loss"]], flush=True)

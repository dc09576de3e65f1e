"""Candidate fix, emulated for a probe: the tail's first block (4 of small's [2, 2, 2]) active from step 0 in the
warm-up-by-steps row (lr 0.01, 200-step schedule, first 65 steps). Blocks 1-3 and 5 join as before.
Usage: tailfirst.py OUT"""
import json, sys
import agora.model as model
from agora.bench.training import TrainingOptions, count_spikes
from agora.config import load_manifest
from agora.lab.train_local import train_model

ALWAYS = 4


class Depth(int):
    """An active depth under which block ALWAYS also counts as active (``layer < depth`` and ``layer >= depth``
    reach these reflected methods first, because Depth subclasses int)."""

    def __gt__(self, layer):  # depth > layer, i.e. layer < depth: the block is active
        return layer == ALWAYS or int(self) > layer

    def __le__(self, layer):  # depth <= layer: the block is bypassed (or joins now)
        return layer != ALWAYS and int(self) <= layer


plain = model.active_depth
model.active_depth = lambda m, step: Depth(plain(m, step))

out = sys.argv[1]
opts = TrainingOptions(preset="small", steps=200, seeds=(0,))
base = load_manifest("small")
m = base.with_overrides(**{"optimizer.name": "adamw", "optimizer.total_steps": 200, "seed": 0,
                           "optimizer.lr": base.optimizer.lr * 10,
                           "training.warmup_depth": {"until": opts.warmup_until, "mode": "steps"}})
summary, net = train_model(m, 65, val_batches=opts.val_batches)
L = summary["train_loss"]
assert net.stages[-1].active_depth > 4 and not any(p is q for p in net.stages[-1].inactive_parameters()
                                                   for q in net.stages[-1].layers["4"].parameters())
json.dump({"variant": "tailfirst", "train_loss": L, "depth": [r["depth"] for r in summary["history"]]}, open(out, "w"))
print("tailfirst spikes", count_spikes(L), "max from 12", round(max(L[12:]), 2), [i for i in range(12, len(L)) if L[i] > 10])
print([round(x, 2) for x in L])

"""In-process emulation of ``agora bench convergence``'s ``sparse`` row, to compare SPARTA settings in minutes.

Two replicas start from the same weights and split each step's microbatches of the centralized stream (the first
half to one, the second half to the other). Each steps on its own gradients (clipped by its own global norm) with
its own AdamW, as a swarm's replicas do between rounds. After every ``every``-th step both snapshot the round's
seeded slice of parameters and Adam moments (``agora.compression.sparse.SparseAverager``, the swarm's own code),
the snapshots are averaged exactly, and each replica applies the average ``delay`` steps later with the delta rule.
Not the swarm: no pipeline, no failed rounds, one partition over the whole model instead of one per stage.

    PYTHONPATH=src python docs/bench/convergence/2026-12-05-sparse-emulation/sparse_emulation.py PRESET SEED STEPS SPEC...

``THREADS`` (environment, default 2): torch threads. SPEC: ``mode=full`` (the replicas' gradients averaged every step: centralized training up to rounding) or
``rho=R,every=H,delay=K``. One JSON line per spec: each replica's validation loss on the bench's 4 held-out batches
and their mean.
"""
import json
import os
import sys
import time

import torch

from agora.compression.sparse import SparseAverager
from agora.data import build_datasets
from agora.lab.demo import demo_manifest
from agora.lab.train_local import evaluate
from agora.model import PipelineModel
from agora.optim import build_optimizer, set_lr


def run(preset: str, seed: int, steps: int, mode: str, rho: float, every: int, delay: int, replicas: int = 2):
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    man = demo_manifest(preset, 3, seed=seed)
    torch.manual_seed(man.seed)
    train, val, _ = build_datasets(man)
    train = train.shard(man.seed, 0, 1)
    models = [PipelineModel(man)]
    models += [PipelineModel(man) for _ in range(replicas - 1)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m, man.optimizer, seed=man.seed) for m in models]
    sparse = [SparseAverager(list(m.named_parameters()), o, seed=("emulation", 0), rho=rho, every=every)
              for m, o in zip(models, opts)] if mode == "sparse" else None
    mb, target = man.batch.microbatch_size, man.batch.target_batch_size
    per = target // mb // replicas
    batches = train.batches(mb, seed=man.seed)
    val_set = val.fixed_batches(mb, 4)
    pending = []  # (apply at step, averaged payload, each replica's snapshot)
    t0 = time.time()
    for step in range(steps):
        for o in opts:
            set_lr(o, man.optimizer, step)
        grads = []
        for m in models:
            for _ in range(per):
                b = next(batches)
                (m.loss(b[:, :-1], b[:, 1:]) / per).backward()
            grads.append([p.grad for p in m.parameters()])
        if mode == "full":
            for tensors in zip(*grads):
                mean = sum(tensors) / replicas
                for t in tensors:
                    t.copy_(mean)
        for m, o in zip(models, opts):
            torch.nn.utils.clip_grad_norm_(m.parameters(), man.optimizer.grad_clip)
            o.step()
            o.zero_grad(set_to_none=True)
        done = step + 1  # optimizer steps taken, as a node counts them
        for due in [p for p in pending if p[0] == done]:
            for s, snap in zip(sparse, due[2]):
                s.apply(snap, due[1], done)
            pending.remove(due)
        if sparse is not None and sparse[0].due(done):
            snaps = [s.snapshot(done) for s in sparse]
            averaged = sum(s.payload for s in snaps) / replicas
            if delay == 0:
                for s, snap in zip(sparse, snaps):
                    s.apply(snap, averaged, done)
            else:
                pending.append((done + delay, averaged, snaps))
    vals = [evaluate(m, val_set) for m in models]
    return vals, time.time() - t0


if __name__ == "__main__":
    preset, seed, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for spec in sys.argv[4:]:
        kv = dict(x.split("=") for x in spec.split(","))
        mode = kv.get("mode", "sparse")
        vals, wall = run(preset, seed, steps, mode, float(kv.get("rho", 0.05)), int(kv.get("every", 4)),
                         int(kv.get("delay", 1)))
        print(json.dumps({"preset": preset, "seed": seed, "steps": steps, "spec": spec, "val": vals,
                          "val_mean": sum(vals) / len(vals), "wall": wall}), flush=True)

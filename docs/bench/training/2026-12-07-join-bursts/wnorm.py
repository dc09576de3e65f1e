"""Norm of the tail's read-out (LM head x final-norm gain) inside and outside the residual's k-dim subspace, during
the 200-step warm-up-by-steps row (lr 0.01, small, seed 0). Usage: wnorm.py OUT VARIANT(steps|nowarm)"""
import json, sys
import torch
from agora.bench.training import TrainingOptions
from agora.config import load_manifest
from agora.lab.train_local import train_model

out, variant = sys.argv[1], sys.argv[2]
opts = TrainingOptions(preset="small", steps=200, seeds=(0,))
base = load_manifest("small")
m = base.with_overrides(**{"optimizer.name": "adamw", "optimizer.total_steps": 200, "seed": 0,
                           "optimizer.lr": base.optimizer.lr * 10})
if variant == "steps":
    m = m.with_overrides(**{"training.warmup_depth": {"until": opts.warmup_until, "mode": "steps"}})
rows = []

def after_step(model, opt, step):
    tail = model.stages[-1]
    u = tail.basis.double()  # d x k, orthonormal columns
    readout = tail.lm_head.weight.detach().double() * tail.norm.weight.detach().double()  # W diag(g)
    inside = readout @ u
    outside = readout - inside @ u.T
    w = tail.lm_head.weight.detach().double()
    rows.append({"step": step, "depth": tail.active_depth, "readout_in": inside.norm().item(),
                 "readout_out": outside.norm().item(), "W_out": (w - (w @ u) @ u.T).norm().item(),
                 "W_in": (w @ u).norm().item(), "gain_rms": tail.norm.weight.detach().pow(2).mean().sqrt().item()})
    r = rows[-1]
    if step % 6 == 0 or step >= 44:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)

train_model(m, 52, val_batches=opts.val_batches, after_step=after_step)
json.dump(rows, open(out, "w"))

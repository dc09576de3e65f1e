"""Diagnostic: is UPM's training loss cost the gain folding (identity rotations fold gains every 2 steps)?"""
import sys, json, time, torch
from agora.config import load_manifest
from agora.frames import enable_frames, rotate_boundary, frame_width, haar_orthogonal, signed_permutation
from agora.lab.train_local import train_model

seeds = [int(s) for s in sys.argv[1].split(",")]
modes = sys.argv[2].split(",")
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
m = load_manifest("small")
out = []
for seed in seeds:
    ms = m.with_overrides(seed=seed)
    for mode in modes:
        gen = torch.Generator().manual_seed(seed + 7)
        n = [0]
        def after_step(model, opt, step, mode=mode, gen=gen, n=n):
            if mode == "none" or (step + 1) % 2:
                return
            stages = list(model.stages)
            moments = lambda p: opt.state.get(p) or None
            if n[0] == 0 or mode == "refold":
                for st in stages:
                    enable_frames(st, moments=moments)
            if mode in ("fold_once", "refold"):
                n[0] += 1
                return
            w = frame_width(stages[0])
            for b in range(len(stages) - 1):
                r = torch.eye(w, dtype=torch.float64) if mode == "identity" else haar_orthogonal(w, gen)
                rotate_boundary(stages, b, r, moments, "mixed")
            n[0] += 1
        t0 = time.time()
        s, _ = train_model(ms, steps, val_batches=8, after_step=after_step)
        out.append({"seed": seed, "mode": mode, "val_loss": s["val_loss"], "n": n[0], "s": time.time() - t0})
        print(json.dumps(out[-1]), flush=True)

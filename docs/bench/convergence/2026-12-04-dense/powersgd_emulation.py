"""In-process emulation of ``agora bench convergence``'s ``powersgd`` row, to compare PowerSGD settings in minutes.

Two replicas split each step's microbatches of the centralized stream (the first half to one, the second half to
the other). Each keeps its own PowerSGD error buffers per stage (``agora.compression.powersgd``), P and Q are
averaged exactly, and the averaged update is clipped by the global norm, as the swarm does. Not the swarm: no
pipeline, no failed rounds, and the tied embedding is one tensor.

    PYTHONPATH=src python docs/bench/convergence/2026-12-04-dense/powersgd_emulation.py SEED STEPS SPEC...

``THREADS`` (environment, default 2): torch threads.

SPEC: ``mode=full`` (average in full every step) or ``rank=R,warm=0|1,full=N,every=K`` (the first N steps averaged in
full: ``averaging.dense_steps``; with ``every=K`` > 0, also every K-th step after them: ``G + E`` averaged in full, the
error buffers emptied). One JSON line per spec: the validation loss on the bench's 4 held-out batches.
"""
import json, os, sys, time, torch
from agora.lab.demo import demo_manifest
from agora.data import build_datasets
from agora.model import PipelineModel
from agora.optim import build_optimizer, set_lr
from agora.lab.train_local import evaluate
from agora.compression.powersgd import PowerSGD

def run(seed, steps, rank, warm_start, full_steps=0, replicas=2, mode="psgd", min_compression=2.0, every=0):
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    man = demo_manifest("small", 3, seed=seed)
    torch.manual_seed(man.seed)
    train, val, _ = build_datasets(man)
    train = train.shard(man.seed, 0, 1)
    model = PipelineModel(man)
    opt = build_optimizer(model, man.optimizer, seed=man.seed)
    mb, target = man.batch.microbatch_size, man.batch.target_batch_size
    accum = target // mb
    batches = train.batches(mb, seed=man.seed)
    val_set = val.fixed_batches(mb, 4)
    seen, params = set(), []
    for st in model.stages:
        ps = [p for p in st.parameters() if id(p) not in seen]
        seen |= {id(p) for p in ps}
        params.append(ps)
    flat = [p for ps in params for p in ps]
    comps = [[PowerSGD([p.shape for p in ps], rank, run_id="sim", stage=i, warm_start=warm_start,
                       min_compression=min_compression) for i, ps in enumerate(params)] for _ in range(replicas)]
    t0 = time.time()
    for step in range(steps):
        set_lr(opt, man.optimizer, step)
        rgrads = []
        per = accum // replicas
        for r in range(replicas):
            for _ in range(per):
                b = next(batches)
                (model.loss(b[:, :-1], b[:, 1:]) / per).backward()
            rgrads.append([p.grad.detach().clone() for p in flat])
            opt.zero_grad(set_to_none=True)
        avg = [sum(g[k] for g in rgrads) / replicas for k in range(len(flat))]
        flush = mode == "psgd" and (step < full_steps or (every > 0 and step % every == 0))
        if flush:  # a dense round of G + E: the error is delivered, the buffers emptied
            out, off = [], 0
            for si, ps in enumerate(params):
                n = len(ps)
                flushed = [comps[r][si].flush(rgrads[r][off:off + n]) for r in range(replicas)]
                out += [sum(f[j] for f in flushed) / replicas for j in range(n)]
                off += n
            avg = out
        elif mode == "psgd":
            out, off = [], 0
            for si, ps in enumerate(params):
                n = len(ps)
                per_r = [g[off:off + n] for g in rgrads]
                cs = [comps[r][si] for r in range(replicas)]
                pp = [cs[r].compress_p(per_r[r], step) for r in range(replicas)]
                pavg = [sum(x[j] for x in pp) / replicas for j in range(len(pp[0]))]
                phat = cs[0].orthogonalize(pavg)
                qq = [cs[r].compute_q(phat) for r in range(replicas)]
                qavg = [sum(x[j] for x in qq) / replicas for j in range(len(qq[0]))]
                passthrough = [sum(x) / replicas for x in zip(*[cs[r].passthrough_tensors(per_r[r]) for r in range(replicas)])]
                res = None
                for r in range(replicas):
                    res = cs[r].assemble(cs[r].decompress(phat, qavg), passthrough)
                out += res
                off += n
            avg = out
        for p, g in zip(flat, avg):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), man.optimizer.grad_clip)
        opt.step(); opt.zero_grad(set_to_none=True)
    return evaluate(model, val_set), time.time() - t0

if __name__ == "__main__":
    seed, steps = int(sys.argv[1]), int(sys.argv[2])
    specs = sys.argv[3:]
    for spec in specs:
        kv = dict(x.split("=") for x in spec.split(","))
        mode = kv.get("mode", "psgd")
        v, w = run(seed, steps, int(kv.get("rank", 4)), kv.get("warm", "1") == "1", int(kv.get("full", 0)),
                   mode=mode, min_compression=float(kv.get("minc", 2.0)), every=int(kv.get("every", 0)))
        print(json.dumps({"seed": seed, "steps": steps, "spec": spec, "val": v, "wall": w}), flush=True)

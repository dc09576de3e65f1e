"""Averaging schemes (agora.compression): N replicas simulated in one process, all-reduce = mean over replicas."""

from __future__ import annotations

import asyncio
from typing import List

import pytest
import torch

from agora.compression import (
    Codec,
    PowerSGD,
    SparseAverager,
    SparsePartition,
    decode,
    encode,
    orthogonalize,
    parts_for_rho,
    quantize,
    stable_seed,
    wire_bytes,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def mean_all_reduce(per_replica: List[List[torch.Tensor]]) -> List[torch.Tensor]:
    """The simulated all-reduce: element-wise mean of each tensor position over the replicas."""
    return [torch.stack(ts).mean(0) for ts in zip(*per_replica)]


# ----------------------------------------------------------------------------------------------- codecs

def test_codecs_cast_and_count_bytes():
    x = torch.tensor([1.0, -2.5, 1e5, -1e6, 1 / 3])
    assert Codec("fp64").bytes_per_element == 8 and Codec.FP16.bytes_per_element == 2
    assert wire_bytes([x, x], Codec.FP32) == 40
    assert encode(x, Codec.FP64).dtype == torch.float64 and encode(x, Codec.BF16).dtype == torch.bfloat16
    fp16 = quantize(x, Codec.FP16)
    assert torch.isfinite(fp16).all() and fp16[3] == -65504.0  # clamped, never inf on the wire
    assert fp16[0] == 1.0 and fp16[1] == -2.5 and fp16[4] != x[4]
    assert torch.equal(quantize(x, Codec.FP32), x) and decode(encode(x, Codec.FP64)).dtype == torch.float32
    assert Codec.FP64.bit_identical and not Codec.FP16.bit_identical
    assert type(Codec.FP16.hivemind_compression()).__name__ == "Float16Compression"
    assert type(Codec.FP32.hivemind_compression()).__name__ == "NoCompression"


def test_stable_seed_is_deterministic_and_distinguishes_parts():
    assert stable_seed("run", 1, 7) == stable_seed("run", 1, 7)
    assert stable_seed("run", 1, 7) != stable_seed("run", 1, 8)
    assert stable_seed(1) != stable_seed("1")
    assert 0 <= stable_seed("x") < 2**63


# ----------------------------------------------------------------------------------------------- PowerSGD

def test_powersgd_seeded_q_identical_across_replicas():
    a = PowerSGD([(16, 8), (8,)], 2, run_id="run", stage=3)
    b = PowerSGD([(16, 8), (8,)], 2, run_id="run", stage=3)
    assert torch.equal(a.initial_q(5)[0], b.initial_q(5)[0])
    assert not torch.equal(a.initial_q(5)[0], a.initial_q(6)[0])
    other_stage = PowerSGD([(16, 8), (8,)], 2, run_id="run", stage=2)
    assert not torch.equal(a.initial_q(5)[0], other_stage.initial_q(5)[0])
    assert a.compressed == [0] and a.passthrough == [1]
    assert a.p_shapes() == [(16, 2)] and a.q_shapes() == [(8, 2)]
    assert a.numel_sent() == 16 * 2 + 8 * 2 + 8


def test_orthogonalize_is_canonical():
    p = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    q = orthogonalize(p)
    torch.testing.assert_close(q.T @ q, torch.eye(3), atol=1e-6, rtol=0)
    assert torch.equal(orthogonalize(p.clone()), q)
    # sign fix: R = Q^T P has a non-negative diagonal, so -P maps to -Q (not to Q with random column signs)
    assert (torch.diagonal(q.T @ p) > 0).all()
    torch.testing.assert_close(orthogonalize(-p), -q)
    z = orthogonalize(torch.zeros(5, 2))  # a zero gradient must not produce NaN
    assert torch.isfinite(z).all()


def _powersgd_round(reps: List[PowerSGD], grads: List[List[torch.Tensor]], step: int) -> List[List[torch.Tensor]]:
    ps = [r.compress_p(g, step) for r, g in zip(reps, grads)]
    phase1 = mean_all_reduce([p + r.passthrough_tensors(g) for p, r, g in zip(ps, reps, grads)])
    n_p = len(ps[0])
    p_hat = [r.orthogonalize(phase1[:n_p]) for r in reps]
    q_avg = mean_all_reduce([r.compute_q(h) for r, h in zip(reps, p_hat)])
    return [r.assemble(r.decompress(h, q_avg), phase1[n_p:]) for r, h in zip(reps, p_hat)]


def test_powersgd_replicas_apply_identical_updates():
    shapes = [(12, 10), (6, 4, 5), (10,), (3, 2)]  # (3, 2) does not compress at rank 2: passthrough
    gen = torch.Generator().manual_seed(0)
    reps = [PowerSGD(shapes, 2, run_id="r", stage=0) for _ in range(4)]
    assert reps[0].compressed == [0, 1] and reps[0].passthrough == [2, 3]
    for step in range(3):
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in reps]
        updates = _powersgd_round(reps, grads, step)
        for u in updates[1:]:
            assert all(torch.equal(a, b) for a, b in zip(updates[0], u))
        assert [tuple(u.shape) for u in updates[0]] == [tuple(s) for s in shapes]
    # The update is the projection of the mean of M = G + E onto the averaged P's span; E = M - update.
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in reps]
    m_mean = torch.stack([g[0] + r.errors[0] for g, r in zip(grads, reps)]).mean(0)
    ps = [r.compress_p(g, 9) for r, g in zip(reps, grads)]
    p_hat = orthogonalize(torch.stack([p[0] for p in ps]).mean(0))
    updates = _powersgd_round(reps, grads, 9)
    torch.testing.assert_close(updates[0][0], p_hat @ p_hat.T @ m_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(updates[0][2], torch.stack([g[2] for g in grads]).mean(0))  # passthrough: exact mean


def test_powersgd_error_feedback_tracks_true_gradient_sum():
    """4 replicas, 32x24 gradients (a fixed full-rank signal + noise), rank 2, 200 steps.

    With feedback: sum(applied) - sum(mean gradient) = -mean(E_T) stays bounded, so the relative gap shrinks
    (measured 0.036); the error norm saturates (max 214 in both halves, 7.5x |G|). Without feedback a rank-2
    truncation loses most of the signal every step (measured relative gap 0.86).
    """
    shape, steps = (32, 24), 200
    signal = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    results = {}
    for feedback in (True, False):
        reps = [PowerSGD([shape], 2, run_id="ef", stage=0) for _ in range(4)]
        gen = torch.Generator().manual_seed(1)
        applied, true = torch.zeros(shape), torch.zeros(shape)
        err_norms = []
        for step in range(steps):
            if not feedback:
                for r in reps:
                    r.reset()
            grads = [[signal + 0.5 * torch.randn(shape, generator=gen)] for _ in reps]
            applied += _powersgd_round(reps, grads, step)[0][0]
            true += torch.stack([g[0] for g in grads]).mean(0)
            mean_err = torch.stack([r.errors[0] for r in reps]).mean(0)
            if feedback:
                torch.testing.assert_close(applied - true, -mean_err, atol=1e-2, rtol=1e-4)
            err_norms.append(float(mean_err.norm()))
        results[feedback] = (float((applied - true).norm() / true.norm()), err_norms)
    gap, norms = results[True]
    assert gap < 0.1, gap
    assert max(norms[steps // 2:]) < 1.25 * max(norms[: steps // 2])  # saturated, not growing
    assert max(norms) < 20 * float(signal.norm())
    assert results[False][0] > 0.5, results[False][0]


def test_powersgd_run_round_async_and_abort():
    shapes = [(12, 8), (8,)]
    reps = [PowerSGD(shapes, 2, run_id="a", stage=1, warm_start=True) for _ in range(3)]
    gen = torch.Generator().manual_seed(2)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in reps]

    async def main(fail: bool):
        phase: dict = {}

        def make_all_reduce(idx: int):
            calls = {"n": 0}

            async def all_reduce(tensors):
                key = calls["n"]
                calls["n"] += 1
                if fail and key == 1:
                    raise TimeoutError("group lost in phase 2")
                slot = phase.setdefault(key, {"in": {}, "event": asyncio.Event()})
                slot["in"][idx] = tensors
                if len(slot["in"]) == len(reps):
                    slot["out"] = mean_all_reduce([slot["in"][i] for i in range(len(reps))])
                    slot["event"].set()
                await slot["event"].wait()
                return slot["out"]
            return all_reduce

        return await asyncio.gather(*(r.run_round(g, 0, make_all_reduce(i)) for i, (r, g) in
                                      enumerate(zip(reps, grads))), return_exceptions=True)

    out = asyncio.run(main(fail=False))
    assert all(torch.equal(out[0][0], o[0]) and torch.equal(out[0][1], o[1]) for o in out)
    assert all(r._last_q[0] is not None for r in reps)  # warm start keeps the averaged Q
    errors_before = [r.errors[0].clone() for r in reps]
    out = asyncio.run(main(fail=True))
    assert all(isinstance(o, TimeoutError) for o in out)
    for r, g, e in zip(reps, grads, errors_before):  # nothing applied: the whole M = G + E is kept as error
        torch.testing.assert_close(r.errors[0], g[0] + e)


def test_powersgd_abort_does_not_alias_the_callers_gradient():
    psgd = PowerSGD([(12, 8)], 2, run_id="x", stage=0)
    grad = torch.randn(12, 8)
    keep = grad.clone()
    psgd.compress_p([grad], step=0)
    psgd.abort()
    grad.zero_()  # the node restarts accumulation in place
    torch.testing.assert_close(psgd.errors[0], keep)


def test_powersgd_flush_applies_the_error_once_and_empties_it():
    psgd = PowerSGD([(12, 8), (8,)], 2, run_id="x", stage=0)
    gen = torch.Generator().manual_seed(3)
    g0 = [torch.randn(12, 8, generator=gen, dtype=torch.float64), torch.randn(8, generator=gen, dtype=torch.float64)]
    psgd.compress_p(g0, step=0)
    psgd.abort()  # a failed round: all of g0 waits in the error buffer
    g1 = [torch.randn(12, 8, generator=gen, dtype=torch.float64), torch.randn(8, generator=gen, dtype=torch.float64)]
    out = psgd.flush(g1)
    torch.testing.assert_close(out[0], g0[0] + g1[0])
    assert out[1] is g1[1]  # passthrough tensors never have an error
    assert psgd.errors == [None]
    torch.testing.assert_close(psgd.flush(g1)[0], g1[0])  # flushed once, not twice
    with pytest.raises(RuntimeError):
        psgd.matrices()  # no round in progress
    psgd.compress_p(g1, step=1)
    torch.testing.assert_close(psgd.matrices()[0], g1[0])


# ----------------------------------------------------------------------------------------------- sparse (SPARTA)

SHAPES = [("w1", (17, 13)), ("b1", (13,)), ("w2", (13, 5))]


def test_partition_identical_across_peers_and_covers_each_element_once():
    assert parts_for_rho(0.05) == 20 and parts_for_rho(0.3) == 4 and parts_for_rho(1.0) == 1
    a = SparsePartition(SHAPES, 20, seed="run-1")
    b = SparsePartition(list(reversed(SHAPES)), 20, seed="run-1")  # another peer, other construction order
    other = SparsePartition(SHAPES, 20, seed="run-2")
    for name, shape in SHAPES:
        assert torch.equal(a.class_ids[name], b.class_ids[name])
        numel = torch.Size(shape).numel()
        seen = torch.cat([a.indices(name, part) for part in range(20)])
        assert torch.equal(seen.sort().values, torch.arange(numel))  # exactly once over N rounds
        sizes = [a.indices(name, part).numel() for part in range(20)]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) == a.slot(name)
    assert not torch.equal(a.class_ids["w1"], other.class_ids["w1"])
    assert [a.part_of_round(r) for r in (0, 19, 20, 41)] == [0, 19, 0, 1]


def _replicas(n: int, seed: int = 0, lr: float = 0.01):
    torch.manual_seed(seed)
    models, opts = [], []
    for i in range(n):
        m = torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * i)  # replicas start apart
        opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        models.append(m)
        opts.append(opt)
    return models, opts


def _train_step(model, opt, gen):
    x = torch.randn(8, 13, generator=gen)
    opt.zero_grad()
    (model(x) ** 2).mean().backward()
    opt.step()


def test_sparse_round_makes_replicas_identical_on_partition():
    models, opts = _replicas(4)
    gen = torch.Generator().manual_seed(0)
    for m, o in zip(models, opts):
        _train_step(m, o, gen)
    avgs = [SparseAverager(list(m.named_parameters()), o, seed="run", rho=0.25, every=1)
            for m, o in zip(models, opts)]
    before = [[p.detach().clone() for p in m.parameters()] for m in models]
    snaps = [a.snapshot(step=4) for a in avgs]  # round 4 -> class 0 of 4
    assert snaps[0].part == 0 and all(torch.equal(s.indices[0], snaps[0].indices[0]) for s in snaps)
    averaged = torch.stack([s.payload for s in snaps]).mean(0)
    for a, s in zip(avgs, snaps):
        assert a.apply(s, averaged.clone(), step=4) == 0
    names = [n for n, _ in models[0].named_parameters()]
    for t, name in enumerate(names):
        idx = snaps[0].indices[t]
        ref = models[0].get_parameter(name).detach().reshape(-1)[idx]
        mean = torch.stack([b[t].reshape(-1)[idx] for b in before]).mean(0)
        torch.testing.assert_close(ref, mean, rtol=1e-6, atol=1e-7)
        mask = torch.ones(before[0][t].numel(), dtype=torch.bool)
        mask[idx] = False
        for m, o, b in zip(models, opts, before):
            p = m.get_parameter(name).detach().reshape(-1)
            assert torch.equal(p[idx], ref)  # bit-identical on the averaged class
            assert torch.equal(p[mask], b[t].reshape(-1)[mask])  # untouched elsewhere
            for key in ("exp_avg", "exp_avg_sq"):
                mine = o.state[m.get_parameter(name)][key].reshape(-1)[idx]
                theirs = opts[0].state[models[0].get_parameter(name)][key].reshape(-1)[idx]
                assert torch.equal(mine, theirs)


def test_sparse_rounds_cover_everything_in_n_rounds():
    models, opts = _replicas(3, lr=0.0)  # lr 0: parameters only move by averaging
    gen = torch.Generator().manual_seed(0)
    for m, o in zip(models, opts):
        _train_step(m, o, gen)
    avgs = [SparseAverager(list(m.named_parameters()), o, seed=7, rho=0.25, every=5) for m, o in zip(models, opts)]
    start = [torch.stack([list(m.parameters())[t].detach() for m in models]).mean(0) for t in range(4)]
    for step in (5, 10, 15, 20):
        assert avgs[0].due(step) and not avgs[0].due(step + 1)
        snaps = [a.snapshot(step) for a in avgs]
        averaged = torch.stack([s.payload for s in snaps]).mean(0)
        for a, s in zip(avgs, snaps):
            a.apply(s, averaged, step)
    assert not avgs[0].due(0)
    for m in models:
        for p, ref in zip(m.parameters(), start):
            torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)
    for m in models[1:]:
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), models[0].parameters()))


def test_sparse_delta_rule_with_delay_and_beta_correction():
    """Applied k steps late: local progress is kept, moments get beta^k, v is clamped at zero."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.8))
    p.grad = torch.ones(4, dtype=torch.float64)
    opt.step()
    avg = SparseAverager([("p", p)], opt, seed="s", rho=1.0, every=1)  # one class: everything
    snap = avg.snapshot(step=1)
    old_p, old_m, old_v = snap.payload.split(4)
    for _ in range(3):  # k = 3 local steps while the round is in flight
        p.grad = torch.tensor([1.0, -1.0, 2.0, 0.5], dtype=torch.float64)
        opt.step()
    cur_p = p.detach().clone()
    cur_m = opt.state[p]["exp_avg"].clone()
    cur_v = opt.state[p]["exp_avg_sq"].clone()
    a_p = old_p + torch.tensor([0.5, -0.5, 1.0, 0.0], dtype=torch.float64)
    a_m = old_m * 0.5
    a_v = old_v - torch.tensor([0.0, 0.0, 100.0, 0.0], dtype=torch.float64)  # would drive v[2] negative
    assert avg.apply(snap, torch.cat([a_p, a_m, a_v]), step=4) == 3
    torch.testing.assert_close(p.detach(), cur_p + (a_p - old_p), rtol=0, atol=1e-12)
    torch.testing.assert_close(opt.state[p]["exp_avg"], cur_m + 0.9**3 * (a_m - old_m), rtol=0, atol=1e-12)
    want_v = (cur_v + 0.8**3 * (a_v - old_v)).clamp(min=0)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], want_v, rtol=0, atol=1e-12)
    assert opt.state[p]["exp_avg_sq"][2] == 0.0 and (opt.state[p]["exp_avg_sq"] >= 0).all()
    with pytest.raises(ValueError):
        avg.apply(snap, torch.zeros(3), step=4)


def test_sparse_requires_moments_and_params_only_mode():
    p = torch.nn.Parameter(torch.zeros(6))
    opt = torch.optim.AdamW([p])
    with pytest.raises(RuntimeError, match="no exp_avg"):
        SparseAverager([("p", p)], opt, seed=0, rho=0.5).snapshot(2)
    params_only = SparseAverager([("p", p)], None, seed=0, rho=0.5, every=2)
    assert params_only.payload_numel() == 3
    snap = params_only.snapshot(2)
    params_only.apply(snap, snap.payload + 1.0, 2)
    assert float(p.detach().sum()) == pytest.approx(3.0)


def test_sparse_averaging_keeps_replicas_together_while_training():
    """4 replicas of logistic regression on heterogeneous shards, AdamW, H = 5, rho = 0.25, rounds applied k = 3
    steps late with the delta rule: the relative consensus distance stays far below no averaging."""
    d, n_rep, steps, every, delay = 40, 4, 120, 5, 3
    gen = torch.Generator().manual_seed(0)
    w_true = torch.randn(d, generator=gen, dtype=torch.float64)
    shards = []
    for i in range(n_rep):
        x = (torch.randn(256, d, generator=gen) + 0.5 * i).double()  # heterogeneous inputs
        shards.append((x, (x @ w_true > 0).double()))

    def run(average: bool) -> float:
        ws = [torch.nn.Parameter(torch.zeros(d, dtype=torch.float64)) for _ in range(n_rep)]
        opts = [torch.optim.AdamW([w], lr=0.05, weight_decay=0.0) for w in ws]
        avgs = [SparseAverager([("w", w)], o, seed="lr", rho=0.25, every=every) for w, o in zip(ws, opts)]
        rng = torch.Generator().manual_seed(1)
        inflight = []
        for step in range(1, steps + 1):
            for w, o, (x, y) in zip(ws, opts, shards):
                idx = torch.randint(0, x.shape[0], (32,), generator=rng)
                o.zero_grad()
                torch.nn.functional.binary_cross_entropy_with_logits(x[idx] @ w, y[idx]).backward()
                o.step()
            if average and inflight and step - inflight[0][0] >= delay:
                _, snaps = inflight.pop(0)
                averaged = torch.stack([s.payload for s in snaps]).mean(0)
                for a, s in zip(avgs, snaps):
                    a.apply(s, averaged, step)
            if average and avgs[0].due(step):
                inflight.append((step, [a.snapshot(step) for a in avgs]))
        stacked = torch.stack([w.detach() for w in ws])
        center = stacked.mean(0)
        return float((stacked - center).norm(dim=1).mean() / center.norm())

    with_avg, without = run(True), run(False)
    print(f"consensus distance: sparse delta rule {with_avg:.4f}, no averaging {without:.4f}")
    assert with_avg < 0.2 and with_avg < 0.5 * without, (with_avg, without)

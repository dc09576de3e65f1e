"""UPM frames (agora.frames): the algebra, and rotated stages computing the same function (METHODS s6, s7)."""

from __future__ import annotations

import pytest
import torch

from agora.config import load_manifest
from agora.frames import (enable_frames, exact_basis, fold_gains, haar_orthogonal, lift, reorthogonalize,
                          rotate_boundary, rotate_input)
from agora.model import build_stages, frozen_embedding, subspace_basis


def _manifest(mode: str = "subspace", stages=(1, 1, 2)):
    m = load_manifest("tiny").with_overrides(stages=list(stages))
    if mode == "dense":
        m = m.with_overrides(**{"residual.mode": "dense", "residual.k": None, "residual.wire_dtype": "fp32"})
    return m


def _perturbed(stages, seed=0):
    """Trained-looking weights: random gains (so folding matters) and non-init values everywhere."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for st in stages:
            for name, p in st.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
                else:
                    p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return stages


def _logits(stages, tokens):
    x = tokens
    for st in stages:
        x = st(x)
    return stages[-1].logits(x)


def test_algebra_group_orthogonality_and_writes_stay_in_the_subspace():
    m = _manifest()
    stage = build_stages(m)[0].double()
    exact_basis(stage)
    u = stage.basis
    g = torch.Generator().manual_seed(0)
    k, d = u.shape[1], u.shape[0]
    r1, r2 = haar_orthogonal(k, g), haar_orthogonal(k, g)
    q1, q2, q12 = lift(stage, r1), lift(stage, r2), lift(stage, r1 @ r2)
    assert (r1.T @ r1 - torch.eye(k, dtype=torch.float64)).abs().max() < 1e-12
    assert (q1.T @ q1 - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-12
    assert (q1 @ q2 - q12).abs().max() < 1e-12  # Q(R1) Q(R2) = Q(R1 R2)
    # Identity on the complement of span(U); R on span(U).
    perp = torch.randn(5, d, generator=g, dtype=torch.float64)
    perp -= perp @ u @ u.T
    assert (perp @ q1 - perp).abs().max() < 1e-12
    # Reconstruction: x = F[tok] + c U^T  ->  x Q = F[tok] + (c R) U^T, since F U = 0.
    assert (frozen_embedding(m.model, subspace_basis(m.model, k, m.seed), m.seed).double()
            @ subspace_basis(m.model, k, m.seed).double()).abs().max() < 1e-6  # F drawn orthogonal to U (fp32)
    f = stage.frozen_embed
    assert (f @ u).abs().max() < 1e-12
    c = torch.randn(7, k, generator=g, dtype=torch.float64)
    x = f[:7] + c @ u.T
    assert (x @ q1 - (f[:7] + (c @ r1) @ u.T)).abs().max() < 1e-12
    # A write A U^T stays in the subspace: (A U^T) Q = (A R) U^T.
    a = torch.randn(4, k, generator=g, dtype=torch.float64)
    assert ((a @ u.T) @ q1 - (a @ r1) @ u.T).abs().max() < 1e-12
    # Haar draws are orthogonal, and a slightly non-orthogonal R is cleaned to the nearest orthogonal matrix.
    noisy = r1 + 1e-4 * torch.randn(k, k, generator=g, dtype=torch.float64)
    clean = reorthogonalize(noisy)
    assert (clean.T @ clean - torch.eye(k, dtype=torch.float64)).abs().max() < 1e-12
    assert (clean - r1).abs().max() < 1e-3


@pytest.mark.parametrize("mode", ["subspace", "dense"])
def test_folding_gains_and_rotating_every_boundary_preserve_the_function_in_fp64(mode):
    m = _manifest(mode)
    stages = [st.double() for st in _perturbed(build_stages(m))]
    for st in stages:
        exact_basis(st)
    tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = _logits(stages, tokens)
        for st in stages:
            fold_gains(st)
        folded = _logits(stages, tokens)
        for st in stages:
            enable_frames(st)
        g = torch.Generator().manual_seed(2)
        width = m.residual.k if mode == "subspace" else m.model.d_model
        for _ in range(20):
            for b in range(m.n_stages - 1):
                rotate_boundary(stages, b, haar_orthogonal(width, g))
            rotate_input(stages[0], haar_orthogonal(width, g))  # the head's own frame is free too
        after = _logits(stages, tokens)
    assert all(float(st.layers[next(iter(st.layers))].input_layernorm.weight.sub(1).abs().max()) == 0 for st in stages)
    assert (folded - before).abs().max() < 1e-9
    assert (after - before).abs().max() < 1e-9
    # ... while the weights really moved: a stage is no longer what it was.
    fresh = [st.double() for st in _perturbed(build_stages(m))]
    w_now = stages[1].layers[str(m.stage_layers(1)[0])].self_attn.q_proj.weight
    w_then = fresh[1].layers[str(m.stage_layers(1)[0])].self_attn.q_proj.weight
    assert (w_now - w_then).abs().max() > 1e-2


def test_shards_one_rotation_apart_do_not_fit_together():
    """Stage 1 captured before a rotation of boundary 0, stage 0 after it: the stitched model computes something
    else (its logits move as far as with stage 1 replaced by unrelated weights, within a factor of a few)."""
    m = _manifest(stages=(2, 2))
    stages = [st.double() for st in _perturbed(build_stages(m), seed=3)]
    for st in stages:
        exact_basis(st)
        enable_frames(st)
    tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        honest = _logits(stages, tokens)
        old_tail = {k: v.clone() for k, v in stages[1].state_dict().items()}
        rotate_boundary(stages, 0, haar_orthogonal(m.residual.k, torch.Generator().manual_seed(5)))
        assert (_logits(stages, tokens) - honest).abs().max() < 1e-9
        stages[1].load_state_dict(old_tail)  # head after the rotation, tail from before it
        stitched = (_logits(stages, tokens) - honest).abs().max()
        other = _perturbed(build_stages(m), seed=6)[1].double()
        exact_basis(other)
        random_tail = [stages[0], other]
        unrelated = (_logits(random_tail, tokens) - honest).abs().max()
    assert stitched > 0.1 * unrelated and stitched > 1e-2


def test_a_tied_embedding_across_stages_is_refused():
    m = _manifest("dense", stages=(2, 2)).with_overrides(**{"model.tie_embeddings": True})
    with pytest.raises(ValueError, match="tied embedding"):
        enable_frames(build_stages(m)[0])


def test_adam_moments_follow_a_signed_permutation_exactly():
    """Dense stages, gains frozen at 1: training one AdamW step then rotating by a signed permutation equals
    rotating (moments included) then training the same step. Every transform is then a signed permutation, under
    which Adam is equivariant, so this checks that m and v are moved with the weights, not left behind."""
    from agora.frames import signed_permutation

    m = _manifest("dense", stages=(2, 2))
    batches = [torch.randint(0, m.model.vocab_size, (2, m.model.seq_len + 1),
                             generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def build():
        stages = [st.double() for st in build_stages(m)]
        for st in stages:
            enable_frames(st)
        params = [p for st in stages for n, p in st.named_parameters() if not n.endswith("norm.weight")]
        return stages, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    def step(stages, opt, rows):
        x = rows[:, :-1]
        for st in stages:
            x = st(x)
        stages[-1].loss(x, rows[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    def step_then_rotate_vs_rotate_then_step(r, v_mode):
        a, opt_a = build()
        b, opt_b = build()
        for rows in batches[:2]:  # non-trivial moments
            step(a, opt_a, rows)
            step(b, opt_b, rows)
        rotate_boundary(b, 0, r, lambda q: opt_b.state.get(q), v_mode)
        step(a, opt_a, batches[2])
        step(b, opt_b, batches[2])
        rotate_boundary(a, 0, r, lambda q: opt_a.state.get(q), v_mode)
        return max((pa - pb).abs().max().item() for sa, sb in zip(a, b)
                   for pa, pb in zip(sa.parameters(), sb.parameters()))

    d = m.model.d_model
    assert step_then_rotate_vs_rotate_then_step(signed_permutation(d, torch.Generator().manual_seed(9)), "mixed") < 1e-10
    # With v left behind ("keep") under a Haar rotation, the same comparison is off: the check can fail.
    off = step_then_rotate_vs_rotate_then_step(haar_orthogonal(d, torch.Generator().manual_seed(9)), "keep")
    assert off > 1e-6


@pytest.mark.parametrize("mode", ["subspace", "dense"])
def test_frames_travel_with_state_and_bake_into_an_ordinary_model(mode, tmp_path):
    """A rotated stage's boundary map is part of its exported state and checkpoint (a joiner gets the frame with
    the weights), a malformed map is refused, and an export bakes the maps away without changing the function."""
    from agora.ops.model_io import export_model, load_model, merge_stages, run_tokenizer, stage_from_state
    from agora.server.observers import Observers
    from agora.server.runtime import Counters, StageRuntime

    m = _manifest(mode, stages=(2, 2))
    runtimes = [StageRuntime(m, i, Counters(), Observers()) for i in range(2)]
    stages = [rt.stage for rt in runtimes]
    _perturbed(stages, seed=11)
    for st in stages:
        enable_frames(st)
    width = m.residual.k if mode == "subspace" else m.model.d_model
    rotate_boundary(stages, 0, haar_orthogonal(width, torch.Generator().manual_seed(12)))
    tokens = torch.randint(0, m.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(13))
    honest = _logits(stages, tokens)

    step, names, tensors = runtimes[0].export_state()
    assert "frame/boundary_map" in names
    joiner = StageRuntime(m, 0, Counters(), Observers())
    joiner.import_state(step, names, tensors)
    assert (joiner.stage.boundary_map - stages[0].boundary_map).abs().max() < 1e-12
    assert (_logits([joiner.stage, stages[1]], tokens) - honest).abs().max() < 1e-5
    bad = [t.clone() * 2 if n == "frame/boundary_map" else t for n, t in zip(names, tensors)]
    with pytest.raises(ValueError, match="not orthogonal"):
        joiner.import_state(step, names, bad)

    rebuilt = [stage_from_state(m, i, *rt.export_state()[1:]) for i, rt in enumerate(runtimes)]
    assert (_logits(rebuilt, tokens) - honest).abs().max() < 1e-5
    export_model(merge_stages(m, rebuilt), tmp_path / "model", run_tokenizer(m))
    loaded = load_model(tmp_path / "model")
    assert all(st.boundary_map is None for st in loaded.model.stages)
    assert (_logits(list(loaded.model.stages), tokens) - honest).abs().max() < 1e-4


def test_subspace_rotations_apply_q_and_its_square_without_a_dense_d_by_d_product():
    """frames._Side.lifted: t Q, t (Q*Q), Q^T t, (Q*Q)^T t in low-rank form equal the dense products (Adam's moments
    of an LM head rotated densely took seconds per rotation on a CPU)."""
    from agora.frames import _Side

    g = torch.Generator().manual_seed(0)
    d, k = 64, 5
    u, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    r = haar_orthogonal(k, g)
    q = torch.eye(d, dtype=torch.float64) + u @ (r - torch.eye(k, dtype=torch.float64)) @ u.T
    right, left = _Side.lifted(r, u, q, on_left=False), _Side.lifted(r, u, q, on_left=True)
    t = torch.randn(7, d, generator=g, dtype=torch.float64)
    assert (right.apply(t) - t @ q).abs().max() < 1e-12
    assert (right.apply_sq(t) - t @ (q * q)).abs().max() < 1e-12
    assert (left.apply(t.T) - q.T @ t.T).abs().max() < 1e-12
    assert (left.apply_sq(t.T) - (q * q).T @ t.T).abs().max() < 1e-12


@pytest.mark.parametrize("v_mode", ["mixed", "keep", "isotropic"])
def test_a_signed_permutation_moves_a_weight_and_its_moments_in_place_bit_for_bit_as_the_product_does(v_mode):
    """frames._transform with signed-permutation sides writes only the rows/columns the permutation moves, in the
    tensor's dtype, and ends bit for bit where the float64 products with the same matrices end (a rotation of
    `small`'s tail cost 124 ms of CPU through the products; on a coordinate basis k = 8 of d = 512 columns move)."""
    from agora.frames import _Side, _transform

    g = torch.Generator().manual_seed(3)
    d, rows = 32, 12
    src = torch.arange(d)
    src[[3, 7, 20, 21]] = torch.tensor([21, 3, 7, 20])  # 4 of 32 coordinates move, as on a coordinate basis
    sign = torch.ones(d, dtype=torch.float64)
    sign[[7, 21, 30]] = -1.0  # 30 only changes sign
    x = torch.zeros(d, d, dtype=torch.float64)
    x[src, torch.arange(d)] = sign  # X[src[j], j] = sign[j]
    left_src = torch.randperm(rows, generator=g)
    left_sign = torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0).double()
    y = torch.zeros(rows, rows, dtype=torch.float64)
    y[left_src, torch.arange(rows)] = left_sign
    for dtype in (torch.float32, torch.bfloat16):
        w0 = torch.randn(rows, d, generator=g).to(dtype)
        state0 = {"exp_avg": torch.randn(rows, d, generator=g).to(dtype),
                  "exp_avg_sq": torch.rand(rows, d, generator=g).to(dtype)}
        results = []
        for sides in ("products", "in place"):
            w = torch.nn.Parameter(w0.clone())
            state = {k: v.clone() for k, v in state0.items()}
            kwargs = (dict(left=y.T, right=x) if sides == "products" else
                      dict(left=None, right=None, left_side=_Side.signed((left_src, left_sign), on_left=True),
                           right_side=_Side.signed((src, sign), on_left=False)))
            with torch.no_grad():
                _transform(w, moments=lambda p: state, v_mode=v_mode, **kwargs)
            results.append((w.detach(), state))
        (w_a, st_a), (w_b, st_b) = results
        assert torch.equal(w_a, w_b) and w_b.dtype == dtype
        assert torch.equal(st_a["exp_avg"], st_b["exp_avg"]) and torch.equal(st_a["exp_avg_sq"], st_b["exp_avg_sq"])
        assert not torch.equal(w_b, w0)  # it did move
        if v_mode == "keep":
            assert torch.equal(st_b["exp_avg_sq"], state0["exp_avg_sq"])

    def no_product(t):
        raise AssertionError("a signed permutation went through the whole-tensor path")

    side = _Side.signed((src, sign), on_left=False)
    side.apply = side.apply_sq = no_product
    w = torch.nn.Parameter(torch.randn(rows, d, generator=g))
    state = {"exp_avg": torch.randn(rows, d, generator=g), "exp_avg_sq": torch.rand(rows, d, generator=g)}
    expected = w.detach()[:, src] * sign.float()
    with torch.no_grad():
        _transform(w, None, None, lambda p: state, v_mode, right_side=side)
    assert torch.equal(w.detach(), expected)


@pytest.mark.parametrize("basis", ["coordinates", "random"])
def test_signed_permutations_of_coordinate_subspaces_move_adam_and_trained_gains_exactly(basis):
    """Subspace stages with trained gains, every parameter under AdamW: with ``residual.basis: coordinates`` a
    signed permutation R lifts to a signed permutation of the whole stream, so gains are permuted (not folded) and
    rotating then stepping equals stepping then rotating. With a random basis the same R moves every read densely
    and folds the gains: the comparison is off there (the control)."""
    from agora.frames import as_signed_permutation, input_gradients, current_gains, signed_permutation

    m = _manifest().with_overrides(**{"residual.basis": basis})
    batches = [torch.randint(0, m.model.vocab_size, (2, m.model.seq_len + 1),
                             generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def build():
        stages = _perturbed([st.double() for st in build_stages(m)])
        for st in stages:
            exact_basis(st)
            enable_frames(st)  # boundary maps; the perturbed gains are folded before training moves them again
        return stages, torch.optim.AdamW([p for st in stages for p in st.parameters()], lr=1e-2, weight_decay=0.1)

    def grads(stages, rows):
        x = rows[:, :-1]
        for st in stages:
            x = st(x)
        stages[-1].loss(x, rows[:, 1:]).backward()

    k = m.residual.k
    r = signed_permutation(k, torch.Generator().manual_seed(5))
    a, opt_a = build()
    b, opt_b = build()
    for rows in batches[:2]:  # non-trivial moments, gains away from 1
        for st, opt in ((a, opt_a), (b, opt_b)):
            grads(st, rows)
            opt.step()
            opt.zero_grad()
    gains_before = b[1].layers[next(iter(b[1].layers))].input_layernorm.weight.detach().clone()
    rotate_boundary(b, 0, r, lambda q: opt_b.state.get(q))
    gains_after = b[1].layers[next(iter(b[1].layers))].input_layernorm.weight.detach().clone()
    grads(a, batches[2])
    grads(b, batches[2])
    # The gradient b took in the new frame is a's, moved (what a backward of the old frame is turned into).
    moved = input_gradients(a[1], {n: p.grad for n, p in a[1].named_parameters()}, r, current_gains(a[1]))
    grad_gap = max((moved[n] - p.grad).abs().max().item() for n, p in b[1].named_parameters())
    opt_a.step()
    opt_b.step()
    rotate_boundary(a, 0, r, lambda q: opt_a.state.get(q))
    gap = max((pa - pb).abs().max().item() for sa, sb in zip(a, b) for pa, pb in zip(sa.parameters(), sb.parameters()))
    exact = as_signed_permutation(lift(b[1], r)) is not None
    if basis == "coordinates":
        assert exact
        assert gap < 1e-10 and grad_gap < 1e-10
        assert not torch.equal(gains_after, gains_before) and torch.equal(gains_after.sort().values,
                                                                           gains_before.sort().values)
    else:
        assert not exact
        assert bool((gains_after == 1).all())  # folded into the reads
        assert gap > 1e-6


def test_signed_permutations_in_fp32_preserve_the_function_to_rounding_and_undo_bit_for_bit():
    """Compounded signed permutations in float32, coordinate basis: weights are only renamed, so the logits differ
    from the originals by summation order alone, and rotating back by the inverse product restores every weight
    bit for bit (however many were compounded: no rounding ever enters)."""
    from agora.frames import signed_permutation

    m = _manifest().with_overrides(**{"residual.basis": "coordinates"})
    stages = _perturbed(build_stages(m))
    for st in stages:
        enable_frames(st)
    original = [{n: p.detach().clone() for n, p in st.named_parameters()} for st in stages]
    tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = _logits(stages, tokens)
    gen = torch.Generator().manual_seed(3)
    total = [torch.eye(m.residual.k, dtype=torch.float64) for _ in range(2)]
    for _ in range(100):
        for b in range(2):
            r = signed_permutation(m.residual.k, gen)
            rotate_boundary(stages, b, r)
            total[b] = total[b] @ r
    with torch.no_grad():
        after = _logits(stages, tokens)
    assert (after - before).abs().max().item() < 1e-4
    for b in range(2):
        rotate_boundary(stages, b, total[b].T.contiguous())
    for st, orig in zip(stages, original):
        for n, p in st.named_parameters():
            assert torch.equal(p.detach(), orig[n]), n
        if st.boundary_map is not None:
            assert torch.equal(st.boundary_map, torch.eye(m.residual.k, dtype=st.boundary_map.dtype))

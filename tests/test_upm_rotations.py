"""UPM rotations on live runtimes (server/upm.py): a pipeline that rotates its frames mid-training, with microbatches
in flight across the rotation, computes and learns exactly what a pipeline without rotations does."""

from __future__ import annotations

import pytest
import torch

from agora.config import ManifestError, load_manifest
from agora.frames import (bake_frames, current_gains, haar_orthogonal, input_gradients, lift, rotate_input,
                          signed_permutation)
from agora.model import Stage
from agora.net.transport import RpcError
from agora.server.observers import Observers
from agora.server.runtime import Counters, StageRuntime
from agora.server.upm import FrameLedger, Rotation


def _manifest(upm: bool, mode: str = "subspace"):
    """``mode``: subspace or dense with Haar rotations; ``coordinates``: subspace with ``residual.basis:
    coordinates`` and signed permutations (``security.upm.transforms``)."""
    m = load_manifest("tiny").with_overrides(stages=[1, 1, 2])
    if mode == "dense":
        m = m.with_overrides(**{"residual.mode": "dense", "residual.k": None})
    if mode == "coordinates":
        m = m.with_overrides(**{"residual.basis": "coordinates"})
    transforms = "signed_permutations" if mode == "coordinates" else "rotations"
    return m.with_overrides(**{"security.upm": {"every_s": 5.0, "transforms": transforms}}) if upm else m


def _pipeline(m):
    return [StageRuntime(m, s, Counters(), Observers()) for s in range(m.n_stages)]


def _batch(seed: int, m, n: int = 2, t: int = 16):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, m.model.vocab_size, (n, t), generator=g, dtype=torch.int32)
    last = torch.randint(0, m.model.vocab_size, (n,), generator=g, dtype=torch.int32)
    return tokens, last


class _InFlight:
    """One microbatch walking the pipeline by hand, so a test decides what happens between its hops."""

    def __init__(self, rts, tokens, last):
        self.rts, self.tokens, self.last = rts, tokens, last
        self.pendings, self.loss = [], None

    def forward_to(self, upto: int) -> None:
        """Forward through stages len(pendings) .. upto (the tail also runs its backward)."""
        for s in range(len(self.pendings), upto + 1):
            rt = self.rts[s]
            if s == 0:
                tensors, frame = [self.tokens, self.last], None
            else:
                prev_rt, prev = self.rts[s - 1], self.pendings[-1]
                tensors, frame = [prev_rt.boundary(prev).coords, self.tokens, self.last], prev.frame_out
            pending, loss = rt.forward(tensors, True, rt.generation, frame)
            self.pendings.append(pending)
            self.loss = loss if loss is not None else self.loss

    def backward(self) -> None:
        grad = self.rts[-1].finish_tail(self.pendings[-1])
        for s in range(len(self.rts) - 2, -1, -1):
            grad = self.rts[s].backward(self.pendings[s], grad)


def _step(rts) -> None:
    for rt in rts:
        _, grads = rt.take_gradients(torch.float32)
        rt.apply_step(grads)


def _logits(rts, tokens):
    x = tokens.long()
    for rt in rts:
        x = rt.stage(x)
    return rts[-1].stage.logits(x)


def _train(rts, rotate: dict | None):
    """One step, then microbatches whose gradients wait for the next one. Microbatch b is forwarded through stages
    0-1 before the step and finished after it, so it crosses the rotations (applied right after step 1) on both
    boundaries; c runs wholly after them. Returns the losses and the gains each stage had at the rotation."""
    m = rts[0].manifest
    if rotate:
        for boundary, r in rotate.items():
            for rt in rts[boundary:boundary + 2]:
                assert rt.frames.accept(Rotation(boundary, 1, 1, r, "drawer")) == "accepted"
    a = _InFlight(rts, *_batch(1, m))
    a.forward_to(2)
    a.backward()
    b = _InFlight(rts, *_batch(2, m))
    b.forward_to(1)  # in flight at stages 0 and 1 across the step
    _step(rts)
    gains = [current_gains(rt.stage) for rt in rts]
    b.forward_to(2)  # stage 2 converts stage 1's old-frame boundary, and the gradient back
    b.backward()  # stage 1's snapshot gradient moves to the new frame
    c = _InFlight(rts, *_batch(3, m))
    c.forward_to(2)
    c.backward()
    return [a.loss, b.loss, c.loss], gains


def _grads(rt):
    return {n: p.grad.clone() for n, p in rt.stage.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["subspace", "dense", "coordinates"])
def test_rotating_with_microbatches_in_flight_computes_exactly_the_same_function_and_gradients(mode):
    """Losses before, across and after the rotations are the plain run's; the gradients accumulated across them are
    the plain run's gradients moved into the new frames (exactly: what the optimizer then does with them is Adam's
    business, docs/UPM.md); the function after the rotations is the plain run's. With signed permutations of a
    coordinate basis nothing is folded, so the gains' gradients move exactly too."""
    torch.manual_seed(0)
    m_plain, m_upm = _manifest(False, mode), _manifest(True, mode)
    plain, rotating = _pipeline(m_plain), _pipeline(m_upm)
    g = torch.Generator().manual_seed(7)
    draw = signed_permutation if mode == "coordinates" else haar_orthogonal
    rs = {0: draw(rotating[0].frames.width, g), 1: draw(rotating[0].frames.width, g)}
    losses_plain, gains = _train(plain, None)
    losses_upm, _ = _train(rotating, rs)
    assert [rt.frames.epoch_in for rt in rotating] == [0, 1, 1]
    assert [rt.frames.epoch_out for rt in rotating] == [1, 1, 0]
    assert losses_upm == pytest.approx(losses_plain, rel=1e-5, abs=1e-6)
    for s, rt in enumerate(rotating):
        want = _grads(plain[s])
        if s > 0:  # the input side of boundary s - 1 rotated
            want = input_gradients(rt.stage, want, rs[s - 1], gains[s])
        got = _grads(rt)
        assert set(got) == set(want)
        for name in got:
            if s > 0 and name in gains[s] and mode != "coordinates":
                # Norm gains: microbatch b ran on older weights than c, so no one point moves their sum; the gain
                # formula is checked exactly at a point in test_gradients_follow_a_rotation_like_the_weights_do.
                continue
            scale = max(1e-3, float(want[name].abs().max()))
            assert (got[name] - want[name]).abs().max() < 1e-4 * scale, (s, name)
    tokens, _ = _batch(9, m_plain, n=3)
    with torch.no_grad():
        want = _logits(plain, tokens)
        assert (_logits(rotating, tokens) - want).abs().max() < 1e-4
    # The weights themselves moved: stage 1 in its new frame is not stage 1 of the plain run...
    p_plain = dict(plain[1].stage.named_parameters())["layers.1.self_attn.q_proj.weight"]
    p_upm = dict(rotating[1].stage.named_parameters())["layers.1.self_attn.q_proj.weight"]
    assert (p_plain - p_upm).abs().max() > 1e-3
    # ...and baked back into the head's frame they are an ordinary model computing the same function.
    bake_frames([rt.stage for rt in rotating])
    with torch.no_grad():
        assert (_logits(rotating, tokens) - want).abs().max() < 1e-4


def test_without_the_conversions_the_gradients_are_wrong():
    """The control: a ledger that forgets to move a stale microbatch's gradient (what a naive rotation does)
    leaves gradients the test above would refuse."""
    torch.manual_seed(0)
    m_plain, m_upm = _manifest(False), _manifest(True)
    plain, rotating = _pipeline(m_plain), _pipeline(m_upm)
    g = torch.Generator().manual_seed(7)
    r = haar_orthogonal(rotating[0].frames.width, g)
    rotating[1].frames.stale_gradients = lambda grads, epoch, weights: grads  # forgets to move them
    _, gains = _train(plain, None)
    _train(rotating, {0: r})
    want = input_gradients(rotating[1].stage, _grads(plain[1]), r, gains[1])
    got = _grads(rotating[1])
    assert max(float((got[n] - want[n]).abs().max()) for n in got) > 1e-3


def test_gradients_follow_a_rotation_like_the_weights_do():
    """input_gradients: the gradient at the rotated weights is the moved gradient at the old ones (with gains
    that the rotation folds)."""
    m = _manifest(False)
    stage = Stage(m, 2).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    stage.boundary_map = None
    x = torch.randn(2, 8, m.model.d_model, generator=g, dtype=torch.float64)
    targets = torch.randint(0, m.model.vocab_size, (2, 8), generator=g)

    def grads(st, inp):
        st.zero_grad()
        st.loss(st(inp), targets).backward()
        return {n: p.grad.clone() for n, p in st.named_parameters()}

    before = grads(stage, x)
    r = haar_orthogonal(m.residual.k, g)
    gains = current_gains(stage)
    moved = input_gradients(stage, before, r, gains)
    q = lift(stage, r)
    rotate_input(stage, r)
    after = grads(stage, x @ q)
    for name in after:
        assert (moved[name] - after[name]).abs().max() < 1e-7 * max(1.0, float(after[name].abs().max())), name


def test_ledger_conversions_history_and_conflicts():
    m = _manifest(True)
    stage = Stage(m, 1)
    ledger = FrameLedger(stage)
    g = torch.Generator().manual_seed(0)
    r1, r2, r3 = (haar_orthogonal(ledger.width, g) for _ in range(3))
    assert ledger.sides() == [0, 1]
    assert ledger.conversion(0) is None and ledger.conversion(None) is None
    assert ledger.accept(Rotation(0, 2, 5, r1, "a")) == "early"
    assert ledger.accept(Rotation(0, 1, 5, r1, "b")) == "accepted"
    assert ledger.accept(Rotation(0, 1, 5, r2, "a")) == "accepted"  # a lower drawer id wins a conflict
    assert torch.allclose(ledger.due[(0, 1)].r, r2)
    # A sender already in frame 1 (it applied first): converted back into ours with R^T.
    c = ledger.conversion(1)
    assert torch.allclose(c, r2.T)
    ledger.apply_due(4, {})
    assert ledger.epoch_in == 0  # not due yet
    ledger.apply_due(5, {})
    assert ledger.epoch_in == 1 and not ledger.due
    assert torch.allclose(ledger.conversion(0), r2)  # a late sender of frame 0: forward
    assert ledger.accept(Rotation(0, 1, 5, r3, "0")) == "applied"
    with pytest.raises(RpcError) as err:
        ledger.conversion(3)
    assert err.value.code == "frame_unknown"
    with pytest.raises(ValueError):
        ledger.accept(Rotation(2, 1, 5, r1, "a"))  # not our boundary
    with pytest.raises(ValueError):
        ledger.accept(Rotation(1, 1, 5, torch.eye(3, dtype=torch.float64), "a"))
    # The epochs travel with a state; a state without them is epoch 0 with an identity map.
    epochs = ledger.export()
    assert epochs.tolist() == [1, 0]
    ledger.restore(torch.tensor([4, 2]))
    assert (ledger.epoch_in, ledger.epoch_out) == (4, 2)
    with pytest.raises(ValueError):
        ledger.restore(torch.tensor([-1, 0]))
    # A run of signed permutations accepts only those: a dense rotation would fold gains and blur Adam's v.
    mc = _manifest(True, "coordinates")
    signed = FrameLedger(Stage(mc, 1), transforms=mc.security.upm.transforms)
    with pytest.raises(ValueError, match="signed permutations"):
        signed.accept(Rotation(0, 1, 5, haar_orthogonal(signed.width, g), "a"))
    assert signed.accept(Rotation(0, 1, 5, signed_permutation(signed.width, g), "a")) == "accepted"


def test_runtime_state_carries_frames_and_epochs():
    m = _manifest(True)
    rts = _pipeline(m)
    g = torch.Generator().manual_seed(1)
    r = haar_orthogonal(rts[0].frames.width, g)
    for rt in rts[:2]:
        rt.frames.accept(Rotation(0, 1, 1, r, "d"))
    _train(rts, None)
    _step(rts)
    assert rts[1].frames.epoch_in == 1
    step, names, tensors = rts[1].export_state()
    fresh = StageRuntime(m, 1, Counters(), Observers())
    fresh.import_state(step, names, tensors)
    assert fresh.frames.epoch_in == 1
    assert torch.allclose(fresh.stage.boundary_map, rts[1].stage.boundary_map, atol=1e-10)  # re-orthogonalised
    tokens, last = _batch(5, m)
    with torch.no_grad():
        x = rts[0].stage(tokens.long())
        assert torch.allclose(fresh.stage(x), rts[1].stage(x), atol=1e-5)


def test_manifest_refuses_what_rotations_do_not_support():
    base = load_manifest("tiny")
    upm = {"security.upm": {"every_s": 5.0}}
    for bad in ({"averaging.scheme": "powersgd"}, {"optimizer.name": "muon"}, {"stages": [4]}):
        with pytest.raises(ManifestError, match="security.upm"):
            base.with_overrides(**bad, **upm)
    assert base.with_overrides(**upm).security.upm.every_s == 5.0
    assert base.with_overrides(**upm).hash != base.hash
    # Signed permutations are exact only on a coordinate basis (or dense): refused on a random one, said why.
    signed = {"security.upm": {"every_s": 5.0, "transforms": "signed_permutations"}}
    with pytest.raises(ManifestError, match="residual.basis: coordinates"):
        base.with_overrides(**signed)
    coords = base.with_overrides(**{"residual.basis": "coordinates"}, **signed)
    assert coords.hash != base.with_overrides(**{"residual.basis": "coordinates"}, **upm).hash
    dense = {"residual.mode": "dense", "residual.k": None}
    assert base.with_overrides(**dense, **signed).security.upm.transforms == "signed_permutations"
    with pytest.raises(ManifestError, match="residual.basis"):
        base.with_overrides(**dense, **{"residual.basis": "coordinates"})
    # The new fields at their defaults leave existing manifests' hashes alone.
    assert "basis" not in base.canonical_json() and "transforms" not in base.with_overrides(**upm).canonical_json()
    from agora.lab.demo_setup import demo_manifest
    assert demo_manifest("tiny", 2, upm_every_s=7.0).security.upm.every_s == 7.0  # the demo's and benches' switch
    assert demo_manifest("tiny", 2).security.upm is None


def test_a_generation_session_survives_rotations_of_every_boundary():
    """KV caches are the same in every frame; a boundary written before a rotation and read after it is converted.
    Logits equal those of the same pipeline without rotations, chunk by chunk."""
    from agora.model import KVCache

    torch.manual_seed(0)
    m_plain, m_upm = _manifest(False), _manifest(True)
    plain, rotating = _pipeline(m_plain), _pipeline(m_upm)
    g = torch.Generator().manual_seed(11)
    for boundary in (0, 1):
        r = haar_orthogonal(rotating[0].frames.width, g)
        for rt in rotating[boundary:boundary + 2]:
            rt.frames.accept(Rotation(boundary, 1, 1, r, "d"))
    tokens, _ = _batch(4, m_plain, n=1, t=12)
    caches = {id(rt): KVCache.for_stage(rt.stage, 1, 12) for rt in plain + rotating}

    def through(rts, chunk, position, upto=None, start=0, x=None, frame=None):
        """Decode ``chunk`` at ``position`` through stages start..upto; returns the last output and its frame."""
        upto = len(rts) - 1 if upto is None else upto
        for s in range(start, upto + 1):
            rt = rts[s]
            tensors = [chunk] if s == 0 else [x, chunk]
            x = rt.decode(caches[id(rt)], tensors, position, rt.generation, frame)
            frame = rt.frame_out
        return x, frame

    zero = lambda rt: rt.apply_step([torch.zeros_like(p) for p in rt.stage.parameters()])  # noqa: E731
    want_a, _ = through(plain, tokens[:, :6], 0)
    got_a, _ = through(rotating, tokens[:, :6], 0)
    assert torch.allclose(got_a, want_a, atol=1e-4)
    # The next chunk leaves stage 0 in frame 0; then every stage steps and rotates; then it goes on.
    mid_plain, _ = through(plain, tokens[:, 6:9], 6, upto=0)
    mid_rot, frame = through(rotating, tokens[:, 6:9], 6, upto=0)
    assert frame == 0
    for rt in plain + rotating:
        zero(rt)
    assert [rt.frames.epoch_in for rt in rotating] == [0, 1, 1]
    want_b, _ = through(plain, tokens[:, 6:9], 6, start=1, x=mid_plain)
    got_b, _ = through(rotating, tokens[:, 6:9], 6, start=1, x=mid_rot, frame=0)  # converted at stage 1
    assert torch.allclose(got_b, want_b, atol=1e-4)
    want_c, _ = through(plain, tokens[:, 9:], 9)
    got_c, _ = through(rotating, tokens[:, 9:], 9)
    assert torch.allclose(got_c, want_c, atol=1e-4)

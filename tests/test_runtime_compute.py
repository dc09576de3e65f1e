"""How a peer computes its stage (device, precision, backward mode) changes memory and speed, not what it learns:
recompute gives a stashed graph's gradients, bf16 autocast stays close to fp32, and a replica in bf16 trains
beside one in fp32."""

import asyncio

import pytest
import torch

from agora.client.trainer import Trainer
from agora.config import load_manifest
from agora.server.node import NodeOptions, StageNode
from agora.server.observers import Observers
from agora.server.runtime import Counters, RuntimeOptions, StageRuntime, resolve_device
from agora.net.dht import make_dht, visible_maddrs
from agora.ops.status import peak_memory_label
from agora.roles import node_summary
from swarm_util import random_batches, wait_until

MAN = load_manifest("tiny").with_overrides(stages=[1, 2, 1])


def _runtimes(options: RuntimeOptions, manifest=MAN):
    return [StageRuntime(manifest, s, Counters(), Observers(), options=options) for s in range(manifest.n_stages)]


def _microbatch(runtimes, tokens, last, step_between=False):
    """Forward through every stage, optionally an optimizer step on every stage while the microbatch is in flight,
    then the backward chain. Returns the loss, the parameter gradients and the gradients sent upstream."""
    pendings, sent = [], [tokens, last]
    loss = None
    for rt in runtimes:
        pending, loss = rt.forward(sent, True, rt.generation)
        pendings.append(pending)
        if not rt.is_tail:
            b = rt.boundary(pending)
            sent = [b.coords, tokens, last]
    if step_between:
        for rt in runtimes[:-1]:
            rt.apply_step([torch.full_like(p, 1e-2, dtype=torch.float64) for p in rt.stage.parameters()])
    upstream = [runtimes[-1].finish_tail(pendings[-1])]
    for rt, pending in zip(reversed(runtimes[:-1]), reversed(pendings[:-1])):
        upstream.append(rt.backward(pending, upstream[-1]))
    grads = [[None if p.grad is None else p.grad.clone() for p in rt.stage.parameters()] for rt in runtimes]
    return loss, grads, upstream


def _step_together(xs, ys, steps: int, seed: int = 0) -> None:
    """Apply the same random (averaged) gradients to the runtimes ``xs`` and ``ys``, stage by stage."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(xs, ys):
            grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1 for p in a.stage.parameters()]
            a.apply_step(grads)
            b.apply_step(grads)


def _import_and_step(xs, ys) -> list:
    """Each of ``ys`` takes the state of its ``xs`` runtime, then both take one more step with the same gradients:
    the pairs of parameters after it."""
    pairs = []
    for a, b in zip(xs, ys):
        b.import_state(*a.export_state())
        grads = [torch.full(p.shape, 0.01, dtype=torch.float64) for p in a.stage.parameters()]
        a.apply_step(grads)
        b.apply_step(grads)
        pairs += list(zip(a.stage.parameters(), b.stage.parameters()))
    return pairs


@pytest.mark.parametrize("mode", ["subspace", "dense"])
@pytest.mark.parametrize("step_between", [False, True], ids=["same-version", "step-in-flight"])
@pytest.mark.parametrize("options", [RuntimeOptions(backward="recompute"), RuntimeOptions(checkpoint_blocks=True),
                                     RuntimeOptions(backward="recompute", checkpoint_blocks=True)],
                         ids=["recompute", "checkpointed", "recompute-checkpointed"])
def test_recompute_and_checkpointing_give_the_gradients_of_a_stashed_graph(mode, step_between, options):
    """Recomputing the stage (``recompute``) or each block (per-block checkpointing) at backward time runs on the
    weights the forward ran on (the snapshot), so a step taken while the microbatch is in flight changes nothing:
    bit-identical loss, parameter gradients and gradients sent upstream."""
    manifest = MAN if mode == "subspace" else MAN.with_overrides(**{"residual.mode": "dense", "residual.k": None})
    tokens = torch.randint(0, manifest.model.vocab_size, (4, manifest.model.seq_len), dtype=torch.int32)
    last = torch.randint(0, manifest.model.vocab_size, (4,), dtype=torch.int32)
    stash = _microbatch(_runtimes(RuntimeOptions(backward="stash"), manifest), tokens, last, step_between)
    runtimes = _runtimes(options, manifest)
    assert all(rt.stage.checkpoint_blocks == options.checkpoint_blocks for rt in runtimes)
    again = _microbatch(runtimes, tokens, last, step_between)
    assert stash[0] == again[0]
    for a, b in zip(stash[1], again[1]):
        for ga, gb in zip(a, b):
            assert torch.equal(ga, gb)
    for ua, ub in zip(stash[2][:-1], again[2][:-1]):
        assert torch.equal(ua, ub)


def test_a_checkpointed_block_recomputes_with_the_attention_kernels_of_its_forward():
    """The attention kernel flags are process-wide: another node's curvature measurement in this process may switch
    to the math kernel between our forward and our backward. The recomputation still uses the forward's kernels
    (another kernel saves other tensors, which the checkpoint would refuse) and gives the same gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from agora.model import Stage

    stage = Stage(MAN, 1)
    x = torch.randn(2, MAN.model.seq_len, MAN.residual.k)
    grads = {}
    for checkpointed in (False, True):
        stage.checkpoint_blocks = checkpointed
        stage.zero_grad(set_to_none=True)
        out = stage(x @ stage.basis.T)
        with sdpa_kernel(SDPBackend.MATH):
            out.pow(2).sum().backward()
        grads[checkpointed] = [p.grad for p in stage.parameters() if p.grad is not None]
    assert len(grads[True]) == len(grads[False]) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_checkpointed_blocks_keep_only_block_inputs_for_the_backward():
    """What a stashed microbatch keeps for its backward (autograd's saved tensors outside checkpoints) shrinks to
    the blocks' inputs, the stage output and what sits outside the blocks; the same count without checkpointing
    is the whole graph."""
    manifest = load_manifest("small")
    x = torch.randn(2, manifest.model.seq_len, manifest.residual.k)
    tokens = torch.randint(0, manifest.model.vocab_size, (2, manifest.model.seq_len), dtype=torch.int32)

    def saved_bytes(checkpoint_blocks: bool) -> int:
        rt = StageRuntime(manifest, 1, Counters(), Observers(), options=RuntimeOptions(
            checkpoint_blocks=checkpoint_blocks))
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            rt.forward([x, tokens, tokens[:, -1]], True, rt.generation)
        return sum(seen.values())

    with_, without = saved_bytes(True), saved_bytes(False)
    assert with_ < without / 4, (with_, without)


def test_bf16_autocast_stays_close_to_fp32_and_keeps_fp32_master_state():
    tokens = torch.randint(0, MAN.model.vocab_size, (4, MAN.model.seq_len), dtype=torch.int32)
    last = torch.randint(0, MAN.model.vocab_size, (4,), dtype=torch.int32)
    full = _microbatch(_runtimes(RuntimeOptions()), tokens, last)
    bf16_runtimes = _runtimes(RuntimeOptions(precision="bf16"))
    half = _microbatch(bf16_runtimes, tokens, last)
    assert half[0] == pytest.approx(full[0], rel=2e-2)
    for a, b in zip(full[1], half[1]):
        for ga, gb in zip(a, b):
            assert gb.dtype == torch.float32  # gradients (and so averaging and steps) stay fp32
            cos = torch.nn.functional.cosine_similarity(ga.flatten(), gb.flatten(), dim=0)
            assert cos > 0.98, float(cos)
    assert all(p.dtype == torch.float32 for rt in bf16_runtimes for p in rt.stage.parameters())
    # ... and it is not secretly fp32: the loss differs in the low digits.
    assert half[0] != full[0]


def test_devices_resolve_or_are_refused_clearly():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="use auto, cpu, cuda"):
        resolve_device("gpu0")
    with pytest.raises(ValueError):
        RuntimeOptions(precision="fp16")
    with pytest.raises(ValueError):
        RuntimeOptions(backward="sometimes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_a_cuda_stage_computes_what_a_cpu_stage_computes():
    tokens = torch.randint(0, MAN.model.vocab_size, (4, MAN.model.seq_len), dtype=torch.int32)
    last = torch.randint(0, MAN.model.vocab_size, (4,), dtype=torch.int32)
    cpu = _microbatch(_runtimes(RuntimeOptions()), tokens, last)
    gpu = _microbatch(_runtimes(RuntimeOptions(device="cuda")), tokens, last)
    assert gpu[0] == pytest.approx(cpu[0], rel=1e-4)
    for ua, ub in zip(cpu[2][:-1], gpu[2][:-1]):
        assert ub.device.type == "cpu"  # what goes on the wire is in host memory
        torch.testing.assert_close(ub, ua, rtol=1e-3, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_a_cuda_replica_stays_within_the_agreement_tolerance_of_a_cpu_replica():
    """The same averaged gradients, stepped by the fused kernel on the GPU and by the loop on the CPU: the weights
    drift apart by rounding only, far inside ``averaging.agreement_tolerance``, so such replicas never resync."""
    cpu, gpu = _runtimes(RuntimeOptions()), _runtimes(RuntimeOptions(device="cuda"))
    assert gpu[0].fused_optimizer and not cpu[0].fused_optimizer
    _step_together(cpu, gpu, 20)
    for a, b in zip(cpu, gpu):
        pa = torch.cat([p.detach().reshape(-1) for p in a.stage.parameters()]).double()
        pb = torch.cat([p.detach().cpu().reshape(-1) for p in b.stage.parameters()]).double()
        assert float((pa - pb).norm() / pa.norm()) < MAN.averaging.agreement_tolerance / 100
    # A CPU replica's state continues on the GPU's fused kernel (its step counts move beside the parameters).
    for x, y in _import_and_step(cpu, gpu):
        torch.testing.assert_close(y.cpu(), x, rtol=1e-5, atol=1e-6)


def test_a_bf16_fused_replica_and_an_fp32_replica_of_one_stage_agree_within_tolerance():
    """Replicas average their (fp32) gradients whatever precision computed them; the bf16 replica also steps with
    the fused AdamW kernel (as a GPU replica does), which rounds the same update differently: the two tails drift
    apart by rounding only, agree within ``averaging.agreement_tolerance`` and announce one fingerprint, with no
    state download once joined. A real divergence is still repaired by a download. The bf16 replica also
    checkpoints its blocks. Each node reports how it computes and its peak memory (summary and record)."""
    manifest = load_manifest("tiny").with_overrides(**{"batch.target_batch_size": 8, "batch.microbatch_size": 4})
    tolerance = manifest.averaging.agreement_tolerance
    layout = [(0, RuntimeOptions()), (1, RuntimeOptions()), (1, RuntimeOptions(precision="bf16", backward="recompute",
                                                                                   checkpoint_blocks=True,
                                                                                   optimizer_kernel="fused"))]

    def distance(a, b):
        pa = torch.cat([p.detach().reshape(-1) for p in a.stage.parameters()]).double()
        pb = torch.cat([p.detach().reshape(-1) for p in b.stage.parameters()]).double()
        return float((pa - pb).norm() / pa.norm())

    async def main():
        boot = make_dht(manifest=manifest)
        peers = visible_maddrs(boot)
        dhts, nodes = [boot], []
        try:
            for stage, compute in layout:
                dht = make_dht(peers, manifest=manifest)
                dhts.append(dht)
                node = StageNode(manifest, stage, dht, NodeOptions(stall_step_s=1e9, averaging_timeout_s=15.0,
                                                                   compute=compute))
                await node.start()
                nodes.append(node)
            trainer = Trainer(manifest, boot, shard=None)
            await trainer.start()
            await wait_until(lambda: [len(s) for s in trainer.swarm] == [1, 2], 30, "every peer to announce")
            for step in (1, 2, 3, 4):
                batches = random_batches(manifest.model.vocab_size, manifest.model.seq_len, 2, 4, seed=step)
                losses = await asyncio.gather(*(trainer.send(b) for b in batches))
                assert all(x is not None for x in losses)
                await wait_until(lambda: all(n.step >= step and n.runtime.samples == 0 for n in nodes), 60,
                                 f"step {step}")
            tails = nodes[1:]
            follower = max(tails, key=lambda n: n.peer_id)  # the replica that compares itself with the other
            await wait_until(lambda: all(n.sync.fingerprint_valid for n in tails)
                             and tails[0].sync.fingerprint == tails[1].sync.fingerprint, 30,
                             "the two tails to announce one version")
            rounding = distance(*tails)
            bitwise = all(torch.equal(a, b) for a, b in zip(tails[0].stage.parameters(), tails[1].stage.parameters()))
            trainer.close()
            reports = [(node_summary(n)["compute"], n.record().metrics) for n in tails]
            rounds, resyncs = [n.sync.rounds_ok for n in tails], [n.sync.resyncs for n in tails]
            failed = sum(n.sync.rounds_failed for n in tails)
            agreed = node_summary(follower)["agreed_within_tolerance"]

            # A real divergence: the follower's weights move far beyond rounding; it adopts the other's state.
            def diverge():
                g = torch.Generator().manual_seed(5)
                with torch.no_grad():
                    for p in follower.stage.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 1e-2)
                follower.runtime.parameter_sample = (follower.runtime.step, follower.runtime.sample_parameters())
                follower.sync._set_fingerprint()

            await follower.run_compute(diverge)
            await wait_until(lambda: follower.sync.resyncs == 1, 30, "the diverged replica to download a state")
            repaired = distance(*tails)
            return rounds, resyncs, failed, reports, rounding, bitwise, agreed, repaired
        finally:
            for node in nodes:
                await node.stop()
            for dht in dhts:
                dht.shutdown()

    rounds, resyncs, failed, reports, rounding, bitwise, agreed, repaired = asyncio.run(main())
    assert min(rounds) >= 3, rounds
    # Rounding never triggers a download. A failed round may: on a loaded machine hivemind can end an all-reduce with
    # part of one replica's average missing (a failed round there, a success for the other), and the replicas then
    # really differ until one adopts the other's state.
    assert sum(resyncs) <= failed, (resyncs, failed)
    assert not bitwise and 0 < rounding < tolerance / 100, rounding  # rounding apart, far inside the tolerance
    assert agreed >= 1
    assert repaired == 0.0
    (plain, plain_record), (mixed, mixed_record) = reports
    assert (plain["precision"], plain["backward"], plain["checkpoint_blocks"]) == ("fp32", "stash", False)
    assert plain["curvature_every"] == 0 and "curvature_hvps" in mixed  # the options and the memory, one key
    assert (mixed["precision"], mixed["backward"], mixed["checkpoint_blocks"]) == ("bf16", "recompute", True)
    assert (plain["optimizer_kernel"], mixed["optimizer_kernel"]) == ("single", "fused")
    for compute, record in reports:
        assert compute["device"] == "cpu" and compute["device_peak_bytes"] is None  # CPU tensors are host memory
        assert compute["host_peak_rss_bytes"] >= compute["host_rss_bytes"] > 50 * 2**20
        assert record["host_peak_rss_bytes"] > 50 * 2**20 and "device_peak_bytes" not in record
        assert peak_memory_label(record).startswith("host ") and peak_memory_label(record).endswith("G")
    assert peak_memory_label({"host_peak_rss_bytes": 2**31, "device_peak_bytes": 3 * 2**30}) == "gpu 3.0G, host 2.0G"
    # another peer's record is untrusted: a malformed value is left out, never an error
    assert peak_memory_label({"host_peak_rss_bytes": "lots", "device_peak_bytes": float("nan")}) == "-"
    assert peak_memory_label({"host_peak_rss_bytes": -1.0, "device_peak_bytes": True}) == "-"


def test_an_offloaded_optimizer_steps_exactly_as_one_beside_the_weights():
    """The optimizer's host copies step to the same weights and moments; state moves between the two kinds."""
    on, off = _runtimes(RuntimeOptions()), _runtimes(RuntimeOptions(offload_optimizer=True))
    _step_together(on, off, 3)
    for a, b in zip(on, off):
        sa, sb = a.export_state(), b.export_state()
        assert sa[1] == sb[1] and any(n.startswith("opt/exp_avg/") for n in sa[1])
        for x, y in zip(sa[2], sb[2]):
            assert torch.equal(x, y)
    # A state exported by one kind of runtime continues identically on the other.
    fresh = _runtimes(RuntimeOptions(offload_optimizer=True))
    for x, y in _import_and_step(on, fresh):
        assert torch.equal(x, y)


def test_a_fused_optimizer_state_moves_to_and_from_the_single_tensor_one():
    """torch's fused AdamW (``--optimizer-kernel fused``, the default on CUDA) keeps the same state as the loop: a
    state exported by either continues on the other within rounding, as a replica on another device downloads it."""
    single, fused = _runtimes(RuntimeOptions()), _runtimes(RuntimeOptions(optimizer_kernel="fused"))
    assert [rt.fused_optimizer for rt in single + fused] == [False] * 3 + [True] * 3
    assert fused[0].memory()["optimizer_kernel"] == "fused"
    gen = torch.Generator().manual_seed(0)
    for a, b in zip(single, fused):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1 for p in a.stage.parameters()]
        a.apply_step(grads)
        b.import_state(*a.export_state())  # single -> fused
        c = _runtimes(RuntimeOptions())[a.stage_index]
        for _ in range(3):
            a.apply_step(grads)
            b.apply_step(grads)
        c.import_state(*b.export_state())  # fused -> single
        a.apply_step(grads)
        c.apply_step(grads)
        assert c.step == a.step == 5
        for x, y in zip(a.stage.parameters(), c.stage.parameters()):
            torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="--optimizer-kernel 'turbo'"):
        RuntimeOptions(optimizer_kernel="turbo")
    nadam = MAN.with_overrides(**{"optimizer.name": "nadam"})
    with pytest.raises(ValueError, match="adamw only"):
        _runtimes(RuntimeOptions(optimizer_kernel="fused"), nadam)
    assert not _runtimes(RuntimeOptions(), nadam)[0].fused_optimizer  # auto on a CPU: the loop


def test_a_process_forked_from_a_node_drops_the_stage_tensors_and_the_node_keeps_them():
    """hivemind's averager is a fork of the node: it must not hold a copy-on-write image of the stage."""
    import os

    rt = StageRuntime(load_manifest("tiny"), 0, Counters(), Observers())
    for p in rt.stage.parameters():
        p.grad = torch.ones_like(p)
    rt.optimizer.step()  # optimizer state exists
    sizes = [p.numel() for p in rt.stage.parameters()]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports what it still holds, then leaves without running pytest's teardown
        held = sum(p.numel() for p in rt.stage.parameters()) + len(rt.optimizer.state)
        os.write(write, str(held).encode())
        os._exit(0)
    os.close(write)
    child_held = int(os.read(read, 64).decode())
    os.waitpid(pid, 0)
    assert child_held == 0
    assert [p.numel() for p in rt.stage.parameters()] == sizes and rt.active


def test_recompute_runs_at_the_depth_and_write_scales_of_its_forward_step():
    """Architecture warm-up with ramped writes: a step taken while the microbatch is in flight changes a joined
    block's write scale (and joins the next block); the recomputed forward must use its own step's, or the
    gradients differ from the stashed graph's."""
    manifest = MAN.with_overrides(**{"optimizer.total_steps": 10,
                                     "training.warmup_depth": {"until": 0.3, "ramp_steps": 4}})
    tokens = torch.randint(0, manifest.model.vocab_size, (4, manifest.model.seq_len), dtype=torch.int32)
    last = torch.randint(0, manifest.model.vocab_size, (4,), dtype=torch.int32)
    results = []
    for backward in ("stash", "recompute"):
        runtimes = _runtimes(RuntimeOptions(backward=backward), manifest)
        for _ in range(2):  # block 1 joins at step 1, writes at 2/4 of full size at step 2 (block 2 joins)
            for rt in runtimes:
                rt.apply_step([torch.full_like(p, 1e-2, dtype=torch.float64) for p in rt.stage.parameters()])
        body = runtimes[1].stage
        assert body.active_depth == 3 and body.write_scales == {"1": 0.5, "2": 0.25}
        assert torch.count_nonzero(body.layers["1"].self_attn.o_proj.weight) > 0
        results.append(_microbatch(runtimes, tokens, last, step_between=True))
        assert body.write_scales == {"1": 0.75, "2": 0.5}  # the step in flight moved the ramps on
    stash, again = results
    assert stash[0] == again[0]
    for a, b in zip(stash[1], again[1]):
        for ga, gb in zip(a, b):
            assert (ga is None and gb is None) or torch.equal(ga, gb)  # None: a block still bypassed

"""Generation through a live swarm (``infer`` sessions): the local model's tokens, clear refusals, failover by
replay, and nodes that keep training and serving afterwards."""

import asyncio
import secrets
import time

import pytest
import torch

from agora.client.generation import GenerationError, GenerationOptions, SwarmSession, generate_in_swarm
from agora.config import load_manifest
from agora.inference import generate, sample_next
from agora.model import KVCache, PipelineModel
from agora.net import transport
from agora.net.dht import make_dht
from agora.net.protocol import FWD_BWD, INFER
from agora.roles import generate_through_swarm
from agora.server.node import NodeOptions, StageNode
from swarm_util import local_swarm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SUBSPACE = load_manifest("tiny")  # 2 stages, k = 8, fp32 wire
DENSE3 = SUBSPACE.with_overrides(**{"residual.mode": "dense", "residual.k": None, "residual.wire_dtype": "fp32",
                                    "stages": [1, 2, 1]})
PROMPT = [5, 17, 300, 42, 9, 1000, 77, 3]


def sharpen(stage, factor=5.0):
    """Scale the weights up from the 0.02 init, so that logits are no near-ties and the greedy tokens vary."""
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if name.endswith(("proj.weight", "lm_head.weight", "embed_tokens.weight")):
                p.mul_(factor)


def local_model(man):
    model = PipelineModel(man)
    for stage in model.stages:  # a tied matrix is shared by two stages here: scale it once
        sharpen(stage)
    return model.eval()


async def sharpen_nodes(nodes):
    """The same change on the swarm's weights, on each node's compute thread (where its parameters live)."""
    for node in nodes:
        await node.run_compute(sharpen, node.stage)
        node.runtime.version += 1


def options(**kw):
    return GenerationOptions(call_timeout_s=20.0, wait_for_peers_s=3.0, backoff_s=0.1, **kw)


async def train_microbatch(p2p, node, man, seed=0):
    """One training microbatch sent to a head: the whole pipeline still forwards and backwards."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, man.model.vocab_size, (2, man.model.seq_len), generator=g, dtype=torch.int32)
    last = torch.randint(0, man.model.vocab_size, (2,), generator=g, dtype=torch.int32)
    meta = {"run_id": man.run_id, "manifest_hash": man.hash, "stage": 0, "train": True}
    reply, _ = await transport.call(p2p, node.peer_id, man.run_id, FWD_BWD, meta, [tokens, last], timeout=30)
    return reply["loss"]


@pytest.mark.parametrize("man,layout", [(DENSE3, [0, 1, 2]), (SUBSPACE, [0, 1])], ids=["dense-3", "subspace-2"])
def test_swarm_generation_equals_local_generation(man, layout):
    """Greedy and seeded sampling through the swarm give the local model's tokens, token for token, also while
    training microbatches share the nodes' compute threads; every session is closed on the peers afterwards."""
    local = local_model(man)
    want_greedy = generate(local, PROMPT, 24)
    want_sampled = generate(local, PROMPT, 24, temperature=0.8, top_p=0.9, seed=7)

    async def main():
        async with local_swarm(man, layout) as (boot, peers, nodes):
            await sharpen_nodes(nodes)
            p2p = await boot.replicate_p2p()
            # Training without a step (the target batch is far away): the weights generation reads stay the same.
            greedy, *losses = await asyncio.gather(generate_in_swarm(man, boot, PROMPT, 24, options=options()),
                                                   *(train_microbatch(p2p, nodes[0], man, seed) for seed in range(3)))
            assert all(loss > 0 for loss in losses)
            sampled = await generate_in_swarm(man, boot, PROMPT, 24, temperature=0.8, top_p=0.9, seed=7,
                                              options=options())
            # The public entry point: its own read-only DHT client, the session, shutdown.
            public = await asyncio.to_thread(generate_through_swarm, man, peers, PROMPT, 6)
            left = [(len(n.inference.sessions), n.inference.reserved) for n in nodes]
            tokens = [n.inference.stats.tokens for n in nodes]
            return greedy, sampled, public, left, tokens

    greedy, sampled, public, left, tokens = asyncio.run(main())
    assert greedy == want_greedy
    assert sampled == want_sampled
    assert public == want_greedy[:6]
    assert len(set(greedy)) > 3  # not a degenerate repetition: the comparison means something
    assert left == [(0, 0)] * len(layout)
    # Prefill once, then one position per new token (the last one is never fed back), per session.
    per_session = [len(PROMPT) + 23, len(PROMPT) + 23, len(PROMPT) + 5]
    assert tokens == [sum(per_session)] * len(layout)


def test_refusals_are_clear_and_the_node_keeps_serving():
    man = SUBSPACE
    seq_len, k, v = man.model.seq_len, man.residual.k, man.model.vocab_size
    one_session = KVCache.nbytes_for(man.model, man.stages[0], 1, seq_len)
    opts = NodeOptions(stall_step_s=1e9, inference_memory_bytes=one_session, inference_idle_s=1.5)

    async def main():
        async with local_swarm(man, [0, 1], opts) as (boot, peers, nodes):
            head, tail = nodes
            p2p = await boot.replicate_p2p()

            async def infer(node, tensors, **meta):
                tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
                meta = {"run_id": man.run_id, "manifest_hash": man.hash, "stage": node.stage_index,
                        "session": secrets.token_hex(8), "position": 0, "close": False} | meta
                return await transport.call(p2p, node.peer_id, man.run_id, INFER, meta, tensors, timeout=20)

            async def code(node, tensors, **meta):
                with pytest.raises(transport.RpcError) as err:
                    await infer(node, tensors, **meta)
                return err.value.code, err.value.message

            ids = torch.tensor([PROMPT], dtype=torch.int32)
            coords = torch.randn(1, len(PROMPT), k)
            nan = coords.clone()
            nan[0, 0, 0] = float("nan")
            codes = {
                "unknown_session": await code(head, ids, position=3),
                "too_large": await code(head, torch.zeros(1, seq_len + 1, dtype=torch.int32)),
                "too_large/capacity": await code(head, ids, capacity=seq_len + 1),
                "bad_token": await code(head, ids.clone().fill_(v)),
                "dtype_mismatch": await code(head, ids.long()),
                "shape_mismatch": await code(head, ids.repeat(2, 1)),
                "bad_request": await code(head, ids, session="x"),
                "wrong_run": await code(head, ids, run_id="another"),
                "manifest_mismatch": await code(head, ids, manifest_hash="0" * 16),
                "wrong_stage": await code(head, ids, stage=1),
                "shape_mismatch/boundary": await code(tail, [torch.randn(1, len(PROMPT), k + 1), ids]),
                "dtype_mismatch/boundary": await code(tail, [coords.bfloat16(), ids]),
                "non_finite": await code(tail, [nan, ids]),
            }
            # A duplicated (or lost) chunk is caught by its position.
            sid = secrets.token_hex(8)
            reply, out = await infer(head, ids, session=sid, capacity=seq_len)
            assert reply["length"] == len(PROMPT) and out[0].shape == (1, len(PROMPT), k)
            codes["position_mismatch"] = await code(head, ids[:, :1], session=sid, position=2)
            reply, _ = await infer(head, ids[:, :1], session=sid, position=len(PROMPT))
            assert reply["length"] == len(PROMPT) + 1
            # The memory cap holds one full-length session: a second one is refused until the first is closed.
            codes["busy"] = await code(head, ids, capacity=seq_len)
            reply, _ = await infer(head, [], session=sid, close=True)
            assert reply["closed"] and head.inference.reserved == 0
            # An idle session expires and gives its memory back.
            sid = secrets.token_hex(8)
            await infer(head, ids, session=sid, capacity=seq_len)
            assert head.inference.reserved == one_session
            await asyncio.sleep(3.0)
            expired = (head.inference.reserved, head.inference.stats.expired)
            codes["unknown_session/expired"] = await code(head, ids[:, :1], session=sid, position=len(PROMPT))
            # A prompt longer than seq_len never reaches the swarm.
            with pytest.raises(ValueError, match="seq_len"):
                await generate_in_swarm(man, boot, list(range(seq_len + 1)), 1)
            # Both nodes still train and serve: a training microbatch through the pipeline, then a generation.
            loss = await train_microbatch(p2p, head, man)
            tokens = await generate_in_swarm(man, boot, PROMPT, 4, options=options())
            return codes, expired, loss, tokens, head.counters.rejected + tail.counters.rejected

    codes, expired, loss, tokens, rejected = asyncio.run(main())
    assert {name: c for name, (c, _) in codes.items()} == {name: name.split("/")[0] for name in codes}, codes
    assert "seq_len" in codes["too_large"][1] and "start a new one" in codes["unknown_session"][1]
    assert "holds 8 positions" in codes["position_mismatch"][1]
    assert expired == (0, 1)
    assert loss == loss and loss > 0  # finite
    assert len(tokens) == 4
    assert rejected >= 11  # validation refusals are counted like fwd_bwd's


def test_dead_stage_fails_clearly_and_the_rest_keeps_serving():
    man = SUBSPACE
    local = local_model(man)

    async def main():
        async with local_swarm(man, [0, 1]) as (boot, peers, nodes):
            head, tail = nodes
            await sharpen_nodes(nodes)
            p2p = await boot.replicate_p2p()
            await tail.stop()  # the only peer of stage 1 leaves (its record says so)
            t0 = time.monotonic()
            with pytest.raises(GenerationError) as err:
                await generate_in_swarm(man, boot, PROMPT, 5, options=options())
            failed_in = time.monotonic() - t0
            # The head closed the session the dead stage broke; a new peer of stage 1 makes the run whole again.
            dht = make_dht(peers, manifest=man)
            try:
                fresh = StageNode(man, 1, dht, NodeOptions(stall_step_s=1e9))
                await fresh.start()
                try:
                    await sharpen_nodes([fresh])
                    tokens = await generate_in_swarm(man, boot, PROMPT, 8, options=options())
                    loss = await train_microbatch(p2p, head, man)
                finally:
                    await fresh.stop()
            finally:
                dht.shutdown()
            return err.value, failed_in, tokens, loss, head.inference.reserved

    error, failed_in, tokens, loss, reserved = asyncio.run(main())
    assert error.stage == 1 and error.code == "no_peers", error
    assert "stage 1" in str(error)
    assert failed_in < 15
    assert tokens == generate(local, PROMPT, 8)
    assert loss == loss and loss > 0
    assert reserved == 0


def test_a_failed_replica_is_replaced_and_the_session_replayed():
    """Stage 1 has two replicas; the pinned one leaves mid-session. The other one gets stage 1's whole input so far
    and the session goes on with the same tokens as local generation."""
    man = DENSE3
    local = local_model(man)
    n_new = 12

    async def main():
        async with local_swarm(man, [0, 1, 1, 2]) as (boot, peers, nodes):
            await sharpen_nodes(nodes)
            p2p = await boot.replicate_p2p()
            session = SwarmSession(man, boot, p2p, len(PROMPT) + n_new - 1, options())
            out = []
            logits = await session.feed(PROMPT)
            while True:
                out.append(int(sample_next(logits[None])[0]))
                if len(out) == n_new:
                    break
                if len(out) == 5:
                    first = session.pinned(1)
                    await next(n for n in nodes if n.peer_id == first).stop()
                logits = await session.feed([out[-1]])
            second = session.pinned(1)
            survivor = next(n for n in nodes if n.peer_id == second)
            held = survivor.inference.stats.tokens
            await session.close()
            return out, session.failovers, first, second, held, [len(n.inference.sessions) for n in nodes]

    out, failovers, first, second, held, left = asyncio.run(main())
    assert out == generate(local, PROMPT, n_new)
    assert failovers == 1 and first != second
    # The replacement got the prompt and the 4 tokens fed before the failure in one replay, then the rest.
    assert held == len(PROMPT) + n_new - 1
    assert left == [0, 0, 0, 0]

"""A tied embedding in a swarm: the head's embedding and the tail's LM head are copies on different peers, and
the step-by-step exchange of their gradients keeps them equal (bit for bit) while both train."""

import asyncio

import torch

from agora.client.trainer import Trainer
from agora.config import load_manifest
from agora.model import PipelineModel
from agora.server.node import NodeOptions
from swarm_util import local_swarm, random_batches, wait_until

MAN = load_manifest("tiny").with_overrides(**{
    "residual.mode": "dense", "residual.k": None, "residual.wire_dtype": "fp32", "model.tie_embeddings": True,
    "batch.microbatch_size": 4, "batch.target_batch_size": 8, "optimizer.lr": 3e-3, "optimizer.warmup_steps": 0,
    "stages": [1, 2, 1]})


def test_head_and_tail_copies_of_a_tied_embedding_stay_equal_while_training():
    opts = NodeOptions(stall_step_s=1e9, averaging_timeout_s=15.0)

    async def main():
        async with local_swarm(MAN, [0, 1, 1, 2, 2], opts) as (boot, peers, nodes):
            head, tails = nodes[0], nodes[3:]
            initial = head.stage.embed_tokens.weight.detach().clone()
            trainer = Trainer(MAN, boot, shard=None)
            await trainer.start()
            await wait_until(lambda: [len(s) for s in trainer.swarm] == [1, 2, 2], 30, "every peer to announce")
            for step in range(1, 4):
                batches = random_batches(MAN.model.vocab_size, MAN.model.seq_len, 2, 4, seed=step)
                losses = await asyncio.gather(*(trainer.send(b) for b in batches))
                assert all(x is not None for x in losses)
                await wait_until(lambda: all(n.step >= step and n.runtime.samples == 0 for n in nodes), 60,
                                 f"every stage at step {step}")
            trainer.close()
            return (initial, head.stage.embed_tokens.weight.detach().clone(),
                    [t.stage.lm_head.weight.detach().clone() for t in tails],
                    [n.sync.tied.exchanged if n.sync.tied else None for n in nodes],
                    [n.sync.tied.failed if n.sync.tied else None for n in nodes])

    initial, embedding, heads, exchanged, failed = asyncio.run(main())
    assert not torch.equal(embedding, initial)  # it trained
    for copy in heads:
        assert torch.equal(copy, embedding)  # and both ends' copies are one matrix, bit for bit
    assert exchanged[0] >= 3 and all(e >= 3 for e in exchanged[3:]), exchanged
    assert exchanged[1:3] == [None, None]  # the body holds no copy
    assert failed[0] == 0 and failed[3:] == [0, 0], failed


def test_without_the_other_ends_gradient_the_copies_would_drift():
    """The exchange is what keeps them equal: the two ends' own gradients of the shared matrix differ."""
    model = PipelineModel(MAN)
    tokens = torch.randint(0, MAN.model.vocab_size, (4, MAN.model.seq_len + 1))
    head, tail = model.stages[0], model.stages[-1]
    # Untie in place to see each use's gradient alone.
    tail.lm_head.weight = torch.nn.Parameter(head.embed_tokens.weight.detach().clone())
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    lookup, projection = head.embed_tokens.weight.grad, tail.lm_head.weight.grad
    assert lookup.abs().sum() > 0 and projection.abs().sum() > 0
    assert not torch.allclose(lookup, projection)

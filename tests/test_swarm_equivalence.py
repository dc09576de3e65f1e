"""A 2-stage swarm computes exactly what the single-process model computes."""

import asyncio

import torch

from agora.config import load_manifest
from agora.model import PipelineModel
from agora.client.trainer import Trainer
from swarm_util import local_swarm


def _batch(man, b=4):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, man.model.vocab_size, (b, man.model.seq_len + 1), generator=g)


def test_two_stage_swarm_matches_single_process_loss_and_grads():
    man = load_manifest("tiny")
    batch = _batch(man)
    ref = PipelineModel(man)
    ref_loss = ref.loss(batch[:, :-1], batch[:, 1:])
    (ref_loss * batch.shape[0]).backward()

    async def main():
        async with local_swarm(man, [0, 1]) as (boot, peers, nodes):
            trainer = Trainer(man, boot, shard=None)
            await trainer.start()
            loss = await trainer.send(batch)
            trainer.close()
            return loss, nodes

    loss, nodes = asyncio.run(main())
    assert abs(loss - ref_loss.item()) < 1e-5
    for node in nodes:
        for name, p in node.stage.named_parameters():
            p_ref = dict(ref.stages[node.stage_index].named_parameters())[name]
            assert torch.allclose(p.grad, p_ref.grad, atol=1e-5), name



def test_backward_after_an_optimizer_step_uses_the_stashed_weights():
    """Weight stashing: the gradient of a microbatch equals the gradient at the weights its forward used, even if
    the stage stepped in between, and no recompute happens."""
    import copy

    man = load_manifest("tiny")
    batch = _batch(man, b=2)
    tokens, last = batch[:, :-1].int(), batch[:, -1].int()
    grad_out = torch.randn(2, man.model.seq_len, man.residual.k, generator=torch.Generator().manual_seed(1))

    async def main():
        async with local_swarm(man, [0]) as (boot, peers, nodes):
            node = nodes[0]
            before = copy.deepcopy(node.stage)
            rt = node.runtime
            pending, _ = await node.run_compute(rt.forward, [tokens, last], True, rt.generation)
            # The stage steps (parameters change in place) while the microbatch is downstream.
            await node.run_compute(rt.apply_step, [torch.randn_like(p) for p in node.stage.parameters()])
            await node.run_compute(rt.backward, pending, grad_out)
            return before, node

    before, node = asyncio.run(main())
    (before(batch[:, :-1]) @ before.basis).backward(grad_out)
    for (name, p), (_, ref) in zip(node.stage.named_parameters(), before.named_parameters()):
        assert not torch.equal(p.detach(), ref.detach()), name  # the live weights did move
        assert torch.allclose(p.grad, ref.grad, atol=1e-6), name

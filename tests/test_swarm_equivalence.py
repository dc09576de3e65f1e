"""A 2-stage swarm computes exactly what the single-process model computes."""

import asyncio

import torch

from agora.config import load_manifest
from agora.model import PipelineModel
from agora.swarm.trainer import Trainer
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

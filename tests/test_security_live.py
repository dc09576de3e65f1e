"""SENTINEL inside a running swarm: a replica that corrupts its gradients is banned, routed around and kept out
of averaging, while its honest twin keeps serving."""

import asyncio

import torch

from agora.config import load_manifest
from agora.security.attacks import install_attack
from agora.swarm.node import NodeOptions
from agora.swarm.trainer import Trainer
from swarm_util import local_swarm

MAN = load_manifest("tiny")


def test_gradient_attacker_is_banned_and_routed_around():
    opts = NodeOptions(stall_step_s=1e9, sentinel=True)

    async def main():
        async with local_swarm(MAN, [0, 1, 1], opts) as (boot, peers, nodes):
            head, honest, attacker = nodes
            install_attack(attacker, "scale:8@bwd")
            trainer = Trainer(MAN, boot, shard=None)
            await trainer.start()
            for _ in range(100):
                if all(len(s) >= 1 for s in trainer.swarm) and len(head.next_records) == 2:
                    break
                await asyncio.sleep(0.2)
                await trainer.refresh()
            g = torch.Generator().manual_seed(3)
            completed = 0
            for _ in range(40):  # 40 rounds of 4 concurrent microbatches: ~160 gradients reach the head
                batch = [torch.randint(0, MAN.model.vocab_size, (2, MAN.model.seq_len + 1), generator=g)
                         for _ in range(4)]
                losses = await asyncio.gather(*(trainer.send(b) for b in batch))
                completed += sum(x is not None for x in losses)
                if attacker.peer_id in head.banned_peers():
                    break
            banned_at = head.acks.get(attacker.peer_id, 0)
            after = await asyncio.gather(*(trainer.send(b) for b in batch))
            trainer.close()
            return head, honest, attacker, banned_at, completed, after

    head, honest, attacker, accepted_from_attacker, completed, after = asyncio.run(main())
    assert attacker.peer_id in head.banned_peers()
    assert honest.peer_id not in head.banned_peers()
    # Bounded: the warm-up (48 messages pooled over both senders) plus a few strikes.
    assert accepted_from_attacker <= 60, accepted_from_attacker
    assert completed > 0 and all(x is not None for x in after)
    assert attacker.counters.forward - attacker.counters.eval >= accepted_from_attacker

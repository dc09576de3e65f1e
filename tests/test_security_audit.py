"""SENTINEL audits in a live (in-process) swarm: a receiver has other replicas of the sender's stage recompute
messages it got (a tail's gradients, a head's activations), and two agreeing recomputations convict."""

import asyncio

import torch

from agora.config import load_manifest
from agora.lab.attacks import install_attack
from agora.net import transport
from agora.net.protocol import FWD_BWD
from agora.server.node import NodeOptions
from swarm_util import local_swarm, wait_until

# No optimizer step during the test (the target batch is never reached): every replica keeps its initial weights,
# so all share one version and every audit can be answered.
MAN = load_manifest("tiny").with_overrides(**{"batch.target_batch_size": 4096})
OPTS = NodeOptions(stall_step_s=1e9, sentinel=True, audit_rate=1.0)


async def _train_until_banned(p2p, heads: list, auditor, attacker, microbatches: int, seed: int) -> None:
    """Send training microbatches to ``heads`` in turn, letting ``auditor``'s audits finish after each, until it
    banned ``attacker`` or ``microbatches`` were sent. (A head routes each to the tail it expects to finish first,
    so how many reach the attacker is up to routing: the cap is generous and the loop ends at the ban.)"""
    meta = {"run_id": MAN.run_id, "manifest_hash": MAN.hash, "stage": 0, "train": True}
    gen = torch.Generator().manual_seed(seed)
    for i in range(microbatches):
        tokens = torch.randint(0, MAN.model.vocab_size, (4, MAN.model.seq_len), generator=gen, dtype=torch.int32)
        last = torch.randint(0, MAN.model.vocab_size, (4,), generator=gen, dtype=torch.int32)
        head = heads[i % len(heads)]
        await transport.call(p2p, head.peer_id, MAN.run_id, FWD_BWD, meta, [tokens, last], timeout=60)
        audits = auditor.screening.tasks()
        if audits:
            await asyncio.wait_for(asyncio.gather(*audits), 60)
        if auditor.sentinel.banned(attacker.peer_id):
            return


def test_a_tail_adding_faint_noise_is_banned_by_audits_and_honest_tails_are_not():
    """Gaussian noise at 0.1 x the gradient's rms is far below what statistics of one message can see (offline even
    0.25 x goes unnoticed). Every accepted gradient is recomputed by another tail (``audit_rate=1``): the noisy
    tail fails two audits and is banned, the honest tails pass theirs (bit-identical recomputations)."""

    async def main():
        async with local_swarm(MAN, [0, 1, 1, 1], OPTS) as (boot, peers, nodes):
            head, attacker = nodes[0], nodes[3]
            install_attack(attacker, "gaussian:0.1@bwd")
            await wait_until(lambda: len(head.downstream.records) == 3, 30, "the head to see three tails")
            await _train_until_banned(await boot.replicate_p2p(), [head], head, attacker, 150, seed=0)
            served = {n.peer_id[-8:]: n.counters.forward for n in nodes[1:]}
            return (head.sentinel.banned_peers(), attacker.peer_id, {n.peer_id for n in nodes[1:3]},
                    head.sentinel.summary(), served)

    banned, attacker, honest, summary, served = asyncio.run(main())
    assert attacker in banned, (summary, served)
    assert not banned & honest, summary
    struck = summary["0/bwd"]["senders"][attacker]["struck"]
    assert any("recomputed by" in r for r in struck), struck


def test_a_head_adding_faint_noise_to_its_activations_is_banned_by_the_tails_audits():
    """The same for activations: the tail (stage 1) has another head recompute the boundary of the same tokens
    (a head needs nothing else), and two agreeing heads convict the noisy one."""

    async def main():
        async with local_swarm(MAN, [1, 0, 0, 0], OPTS) as (boot, peers, nodes):
            tail, heads, attacker = nodes[0], nodes[1:], nodes[3]
            install_attack(attacker, "gaussian:0.1@fwd")
            await _train_until_banned(await boot.replicate_p2p(), heads, tail, attacker, 100, seed=1)
            return tail.sentinel.banned_peers(), attacker.peer_id, {h.peer_id for h in heads[:2]}, tail.sentinel.summary()

    banned, attacker, honest, summary = asyncio.run(main())
    assert attacker in banned, summary
    assert not banned & honest, summary
    assert any("recomputed by" in r for r in summary["0/fwd"]["senders"][attacker]["struck"]), summary

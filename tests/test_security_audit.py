"""SENTINEL audits in a live (in-process) swarm: a receiver has other replicas of the sender's stage recompute
messages it got (a tail's gradients, a head's activations), and two agreeing recomputations convict."""

import asyncio
import dataclasses
import json

import pytest
import torch

from agora.config import load_manifest
from agora.lab.attacks import install_attack
from agora.net import transport
from agora.net.protocol import FWD_BWD
from agora.server.node import NodeOptions
from agora.server.runtime import RuntimeOptions
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


def test_a_bf16_head_is_audited_at_its_own_precision_and_not_convicted(tmp_path):
    """A head computing in bf16 sends boundaries 0.6-0.8% away from what fp32 computes on the same weights, far
    beyond the audit tolerance: recomputed by two fp32 heads it would be convicted although honest. Its record
    announces its precision, and the auditors recompute at it: every audit of it confirms the message (the
    tail's SENTINEL log: not flagged, no reason)."""
    log = tmp_path / "sentinel.jsonl"
    tail_opts = dataclasses.replace(OPTS, sentinel_log=str(log))
    bf16 = dataclasses.replace(OPTS, compute=RuntimeOptions(precision="bf16"))

    async def main():
        async with local_swarm(MAN, [1, 0, 0, 0], [tail_opts, OPTS, OPTS, bf16]) as (boot, peers, nodes):
            tail, plain, mixed = nodes[0], nodes[1], nodes[3]
            await wait_until(lambda: mixed.record().precision == "bf16", 10, "the bf16 head's record")
            p2p = await boot.replicate_p2p()
            await _train_until_banned(p2p, [mixed], tail, mixed, 12, seed=2)
            # An audit request names the precision to recompute at; the fp32 head computes the bf16 head's message
            # bit for bit at bf16, and refuses a precision that does not exist.
            tokens = torch.randint(0, MAN.model.vocab_size, (4, MAN.model.seq_len), dtype=torch.int32)
            last = torch.randint(0, MAN.model.vocab_size, (4,), dtype=torch.int32)
            meta = {"run_id": MAN.run_id, "manifest_hash": MAN.hash, "stage": 0, "train": False, "audit": True}
            answers = [(await transport.call(p2p, head.peer_id, MAN.run_id, FWD_BWD, dict(meta, precision=p),
                                             [tokens, last], timeout=60))[1][0]
                       for head, p in ((mixed, None), (plain, "bf16"), (plain, "fp32"))]
            with pytest.raises(transport.RpcError, match="bad_request"):
                await transport.call(p2p, plain.peer_id, MAN.run_id, FWD_BWD, dict(meta, precision="fp16"),
                                     [tokens, last], timeout=60)
            return tail.sentinel.banned_peers(), tail.sentinel.summary(), mixed.peer_id, answers

    banned, summary, mixed, (bf16_own, bf16_audit, fp32_audit) = asyncio.run(main())
    assert torch.equal(bf16_own, bf16_audit) and not torch.equal(bf16_own, fp32_audit)
    assert not banned, summary
    audits = [json.loads(line) for line in log.read_text().splitlines()]
    audits = [a for a in audits if a["direction"] == "audit fwd" and a["sender"] == mixed]
    assert len(audits) >= 3, audits
    assert all(not a["flagged"] and a["reasons"] == [] for a in audits), audits
    assert not summary["0/fwd"]["senders"][mixed]["struck"], summary

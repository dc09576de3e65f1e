"""Hostile clients against a live 2-stage swarm (agora.lab.hostile): while outsiders send 200 MiB requests, drips,
slow streams and more streams than allowed, the node buffers within its budget, answers every hostile stream with a
typed error and closes it, and a trainer keeps training. Honest traffic alone never meets a limit."""

from __future__ import annotations

import asyncio
import statistics
import time

import psutil

from agora.client.trainer import Trainer
from agora.config import load_manifest
from agora.lab.hostile import attack
from agora.net import transport
from agora.net.protocol import FWD_BWD, INFO
from agora.server.node import NodeOptions
from hivemind.p2p import P2P
from swarm_util import local_swarm, random_batches, wait_until

MAN = load_manifest("tiny")


async def _timed_rounds(trainer: Trainer, rounds: int, seed: int) -> list[float]:
    """Seconds per round of 4 concurrent microbatches (each must come back with a loss)."""
    times = []
    for r in range(rounds):
        t0 = time.monotonic()
        losses = await asyncio.gather(*(trainer.send(b) for b in random_batches(
            MAN.model.vocab_size, MAN.model.seq_len, 4, 4, seed=seed + r)))
        assert all(x is not None for x in losses), losses
        times.append(time.monotonic() - t0)
    return times


def test_a_node_under_attack_stays_within_its_budget_and_keeps_training():
    opts = NodeOptions(stall_step_s=1e9)

    async def main():
        async with local_swarm(MAN, [0, 1], opts) as (boot, peers, nodes):
            head = next(n for n in nodes if n.stage_index == 0)
            trainer = Trainer(MAN, boot, shard=None)
            await trainer.start()
            await wait_until(lambda: all(len(s) == 1 for s in trainer.swarm), 30, "both stages to announce")
            await _timed_rounds(trainer, 2, seed=0)  # warm-up
            clean = await _timed_rounds(trainer, 6, seed=10)
            assert all(not n.incoming.refused for n in nodes), [n.incoming.snapshot() for n in nodes]

            outsiders = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers)
                         for _ in range(3)]
            try:
                meta = {"run_id": MAN.run_id, "manifest_hash": MAN.hash, "stage": 0, "train": True}
                pid = head.dht.peer_id
                rss_before = psutil.Process().memory_info().rss
                hostile = [attack(outsiders[i % 2], pid, MAN.run_id, FWD_BWD, "huge", meta, 30) for i in range(16)]
                hostile += [attack(outsiders[i % 2], pid, MAN.run_id, FWD_BWD, kind, meta, 30)
                            for kind in ("drip", "garbage", "slow", "huge_frame") for i in range(4)]
                # One identity opens more streams than it may hold.
                hostile += [attack(outsiders[2], pid, MAN.run_id, FWD_BWD, "silent", meta, 30) for _ in range(40)]
                attacking = asyncio.gather(*hostile)
                await asyncio.sleep(0.5)
                t0 = time.monotonic()
                await transport.call(outsiders[0], pid, MAN.run_id, INFO, {}, [], 5)  # info answers under attack
                info_s = time.monotonic() - t0
                under_attack = await _timed_rounds(trainer, 6, seed=20)
                outcomes = await attacking
                rss_growth = psutil.Process().memory_info().rss - rss_before
            finally:
                for p2p in outsiders:
                    await p2p.shutdown()

            by_kind: dict[str, list] = {}
            for o in outcomes:
                by_kind.setdefault(o.attack, []).append(o)
            assert {o.code for o in by_kind["huge"]} == {"too_large"}, by_kind["huge"]
            assert {o.code for o in by_kind["drip"] + by_kind["garbage"]} == {"malformed"}
            assert {o.code for o in by_kind["slow"]} == {"too_slow"}
            assert {o.code for o in by_kind["huge_frame"]} == {"payload_too_large"}
            silent = [o.code for o in by_kind["silent"]]
            assert silent.count("busy") == 40 - head.incoming.limits.streams_per_peer, silent
            assert set(silent) == {"busy", "too_slow"}
            assert all(o.closed_after_s is not None for o in outcomes), [o for o in outcomes if o.closed_after_s is None]
            drips = [o.closed_after_s for o in by_kind["drip"] + by_kind["garbage"] + by_kind["huge"]]
            # Refused streams are closed in bounded time: a drain and a linger of at most ``drain_s`` each, plus
            # scheduling on a loaded machine (CI measured 5.10 s once). The 5 s target is `agora bench hostile`'s.
            limits = head.incoming.limits
            assert max(drips) < 2 * limits.drain_s + 3.0, drips

            state = head.incoming.snapshot()
            assert state["peak_buffered_bytes"] <= state["budget_bytes"], state
            assert state["open_streams"] == 0 and state["buffered_bytes"] == 0, state
            # 16 x 200 MiB were announced; what this process (node, trainer and attackers) grew by is noise.
            assert rss_growth < 200 * 2**20, rss_growth / 2**20
            assert info_s < 2.0, info_s
            # Training went on: every microbatch came back. (The 10% step-time target is measured by
            # `agora bench hostile`; here a loaded 2-core machine only bounds it loosely.)
            assert statistics.median(under_attack) < 3 * statistics.median(clean) + 1.0, (clean, under_attack)
            trainer.close()

    asyncio.run(asyncio.wait_for(main(), 240))

"""``agora bench hostile``: what outsiders' hostile streams cost a node and the trainers it serves.

A 2-stage swarm (nodes and one trainer in this process) trains rounds of one target batch (its microbatches sent
concurrently; the stages step once per round). Each repeat times ``rounds`` rounds clean, then ``rounds`` rounds
while a separate attacker process (own libp2p daemons, three identities) sends ``agora.lab.hostile.WAVE`` after
``WAVE`` at the head's ``fwd_bwd``: 16 streams announcing 200 MiB, drips after invalid headers, garbage, slow
senders, a 1 TiB frame prefix, and 40 silent streams from one identity. The attackers share this machine's CPUs,
which real outsiders would not: the step-time ratio is an upper bound of the cost.

Reported: median round time clean and under attack (median over repeats, with the spread), the head's peak
buffered bytes against its budget, this process's memory growth during the attacked phase and, as the control,
during the clean phase (nodes and trainer share the process), and every hostile stream's outcome (error code, time
until the node closed it).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import psutil

from agora.bench.common import markdown_table, write_result
from agora.config import Manifest, load_manifest


def _attacker(maddrs: list[str], peer_id: str, manifest_path_or_preset: str, stop, results) -> None:
    """The attacker process: waves of hostile streams until ``stop`` is set; outcomes go to ``results``."""
    from hivemind.p2p import P2P, PeerID

    from agora.lab.hostile import attack_waves
    from agora.net.protocol import FWD_BWD

    manifest = load_manifest(manifest_path_or_preset)

    async def main() -> list[dict]:
        p2ps = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs) for _ in range(3)]
        try:
            halt = asyncio.Event()

            async def watch() -> None:
                while not stop.is_set():
                    await asyncio.sleep(0.2)
                halt.set()

            watcher = asyncio.create_task(watch())
            meta = {"run_id": manifest.run_id, "manifest_hash": manifest.hash, "stage": 0, "train": True}
            outcomes = await attack_waves(p2ps, PeerID.from_base58(peer_id), manifest.run_id, FWD_BWD, meta, halt)
            watcher.cancel()
            return [o.as_dict() for o in outcomes]
        finally:
            for p2p in p2ps:
                await p2p.shutdown()

    results.put(asyncio.run(main()))


async def _round(trainer, manifest: Manifest, seed: int) -> float:
    import torch

    b, g = manifest.batch, torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, manifest.model.vocab_size, (b.microbatch_size, manifest.model.seq_len + 1), generator=g)
               for _ in range(max(1, b.target_batch_size // b.microbatch_size))]
    t0 = time.monotonic()
    losses = await asyncio.gather(*(trainer.send(x) for x in batches))
    if any(x is None for x in losses):
        raise RuntimeError("a microbatch was abandoned")
    return time.monotonic() - t0


async def _measure(preset: str, rounds: int, repeats: int, log: Callable[[str], None]) -> dict:
    from agora.client.trainer import Trainer
    from agora.net.dht import make_dht, visible_maddrs
    from agora.server.node import NodeOptions, StageNode

    manifest = load_manifest(preset)
    boot = make_dht(manifest=manifest)
    peers = visible_maddrs(boot)
    dhts, nodes = [boot], []
    ctx = mp.get_context("spawn")
    try:
        for stage in (0, 1):
            dhts.append(make_dht(peers, manifest=manifest))
            nodes.append(StageNode(manifest, stage, dhts[-1], NodeOptions()))
            await nodes[-1].start()
        head = nodes[0]
        trainer = Trainer(manifest, boot, shard=None)
        await trainer.start()
        deadline = time.monotonic() + 60
        while not all(len(s) >= 1 for s in trainer.swarm):
            if time.monotonic() > deadline:
                raise RuntimeError("the stages did not announce within 60 s")
            await asyncio.sleep(0.2)
        for i in range(2):  # warm-up
            await _round(trainer, manifest, seed=i)
        repeats_out = []
        for r in range(repeats):
            refused_before = Counter(head.incoming.refused)
            rss_clean0 = psutil.Process().memory_info().rss
            clean = [await _round(trainer, manifest, seed=100 * r + i) for i in range(rounds)]
            rss_growth_clean = psutil.Process().memory_info().rss - rss_clean0  # the control: training alone
            refused_clean = dict(Counter(head.incoming.refused) - refused_before)  # honest traffic alone
            stop, results = ctx.Event(), ctx.Queue()
            attacker = ctx.Process(target=_attacker, args=(peers, str(head.dht.peer_id), preset, stop, results))
            rss0 = psutil.Process().memory_info().rss
            attacker.start()
            await asyncio.sleep(3.0)  # the attacker's daemons start and its first wave is in flight
            attacked = [await _round(trainer, manifest, seed=100 * r + 50 + i) for i in range(rounds)]
            rss_growth = psutil.Process().memory_info().rss - rss0
            stop.set()
            outcomes = await asyncio.get_running_loop().run_in_executor(None, results.get, True, 120)
            attacker.join(30)
            state = head.incoming.snapshot()
            row = {"clean_s": clean, "attacked_s": attacked, "clean_median_s": statistics.median(clean),
                   "attacked_median_s": statistics.median(attacked),
                   "ratio": statistics.median(attacked) / statistics.median(clean),
                   "refused_while_clean": refused_clean, "rss_growth_bytes": rss_growth,
                   "rss_growth_clean_bytes": rss_growth_clean, "incoming": state,
                   "outcomes": Counter(f"{o['attack']}:{o['code']}" for o in outcomes),
                   "hostile_streams": len(outcomes),
                   "refused_closed_max_s": max((o["closed_after_s"] or float("inf")) for o in outcomes
                                               if o["attack"] in ("huge", "drip", "garbage", "huge_frame"))}
            log(f"repeat {r + 1}: round {row['clean_median_s']:.3f} s clean, {row['attacked_median_s']:.3f} s "
                f"under attack (x{row['ratio']:.2f}); {len(outcomes)} hostile streams; peak buffered "
                f"{state['peak_buffered_bytes'] / 2**20:.2f} of {state['budget_bytes'] / 2**20:.0f} MiB")
            repeats_out.append(row)
        trainer.close()
        return {"preset": preset, "rounds": rounds, "repeats": repeats_out}
    finally:
        for node in nodes:
            try:
                await node.stop()
            except Exception:  # noqa: BLE001 (best effort on the way out)
                pass
        for dht in dhts:
            dht.shutdown()


def run(out: Path, preset: str = "tiny", rounds: int = 30, repeats: int = 3,
        log: Callable[[str], None] = print) -> dict:
    result = asyncio.run(_measure(preset, rounds, repeats, log))
    reps = result["repeats"]
    ratios = [r["ratio"] for r in reps]
    budget = reps[-1]["incoming"]["budget_bytes"]
    result["headline"] = {
        "step_time_ratio_median": statistics.median(ratios), "step_time_ratio_range": [min(ratios), max(ratios)],
        "goal_step_time_within_10pct": statistics.median(ratios) <= 1.10,
        "peak_buffered_bytes": max(r["incoming"]["peak_buffered_bytes"] for r in reps), "budget_bytes": budget,
        "goal_buffered_within_budget": all(r["incoming"]["peak_buffered_bytes"] <= budget for r in reps),
        "rss_growth_bytes_max": max(r["rss_growth_bytes"] for r in reps),
        "rss_growth_clean_bytes_max": max(r["rss_growth_clean_bytes"] for r in reps),
        "refused_streams_closed_max_s": max(r["refused_closed_max_s"] for r in reps),
        "goal_closed_within_5s": all(r["refused_closed_max_s"] < 5.0 for r in reps),
        "honest_refusals": sum(sum(r["refused_while_clean"].values()) for r in reps),
    }
    rows = [[i + 1, f"{r['clean_median_s']:.3f}", f"{r['attacked_median_s']:.3f}", f"{r['ratio']:.2f}",
             r["hostile_streams"], f"{r['incoming']['peak_buffered_bytes'] / 2**20:.2f}",
             f"{r['rss_growth_clean_bytes'] / 2**20:.0f} / {r['rss_growth_bytes'] / 2**20:.0f}",
             f"{r['refused_closed_max_s']:.2f}"] for i, r in enumerate(reps)]
    h = result["headline"]
    md = (f"# bench hostile ({preset}, {rounds} rounds x {len(reps)} repeats)\n\n"
          + markdown_table(["repeat", "round s clean", "round s attacked", "ratio", "hostile streams",
                            "peak buffered MiB", "RSS growth MiB clean / attacked", "refused closed max s"], rows)
          + f"\n\nstep time ratio median {h['step_time_ratio_median']:.2f} (range "
            f"{h['step_time_ratio_range'][0]:.2f}-{h['step_time_ratio_range'][1]:.2f}; goal <= 1.10: "
            f"{'met' if h['goal_step_time_within_10pct'] else 'NOT met'}); budget {budget / 2**20:.0f} MiB; "
            f"honest refusals {h['honest_refusals']}. The attackers ran on the same CPUs.\n")
    write_result(out, "hostile", result, md)
    return result

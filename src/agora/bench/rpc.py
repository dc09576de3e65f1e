"""``agora bench rpc``: what one stage hop costs on loopback, and how much of a microbatch is not compute.

1. Round trip of one streamed RPC carrying a boundary-sized payload out and a gradient-sized payload back,
   between two real hivemind peers (separate libp2p daemons) on 127.0.0.1, for the boundaries of ``small`` and
   ``agora-8b`` in dense fp32 and subspace bf16. The handler does no compute, so this is pure transport.
2. A 2-stage ``small`` swarm in this process: wall time of each microbatch at the trainer vs the compute time
   the stages report for it; the rest (serialization, transport, queueing, event loop) is the overhead share.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from agora.bench.common import markdown_table, write_result
from agora.config import DENSE_RESIDUAL, load_manifest
from agora.net import transport
from agora.net.dht import make_dht, visible_maddrs


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def payloads() -> list[dict]:
    out = []
    for preset, batch in (("small", 8), ("agora-8b", 1)):
        m = load_manifest(preset)
        t, d, k = m.model.seq_len, m.model.d_model, m.residual.k
        out.append({"preset": preset, "mode": "dense fp32", "shape": (batch, t, d), "dtype": torch.float32})
        out.append({"preset": preset, "mode": f"subspace k={k} bf16", "shape": (batch, t, k), "dtype": torch.bfloat16})
    return out


async def _hop_rtts(repeats: int, log: Callable[[str], None]) -> list[dict]:
    server, client = make_dht(), None
    try:
        client = make_dht(visible_maddrs(server))
        p2p_server, p2p_client = await server.replicate_p2p(), await client.replicate_p2p()

        async def echo(meta, tensors, peer):
            return {"ok": True}, [torch.zeros_like(tensors[0])]  # a gradient of the same shape goes back

        await transport.add_handler(p2p_server, "bench", "hop", echo)
        rows = []
        for p in payloads():
            coords = torch.randn(p["shape"]).to(p["dtype"])
            tokens = torch.zeros(p["shape"][:2], dtype=torch.int32)
            tensors = [coords, tokens]
            n = repeats if coords.numel() * coords.element_size() < 2**24 else max(3, repeats // 5)
            await transport.call(p2p_client, server.peer_id, "bench", "hop", {}, tensors, timeout=120)  # warm-up
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                await transport.call(p2p_client, server.peer_id, "bench", "hop", {}, tensors, timeout=120)
                times.append(time.perf_counter() - t0)
            nbytes = coords.numel() * coords.element_size() + tokens.numel() * 4
            rows.append({**{k: v for k, v in p.items() if k != "dtype"}, "bytes_each_way": nbytes, "n": n,
                         "p50_ms": 1e3 * _pct(times, 0.5), "p95_ms": 1e3 * _pct(times, 0.95)})
            log(f"[rpc] {p['preset']} {p['mode']}: {nbytes} B, p50 {rows[-1]['p50_ms']:.1f} ms")
        return rows
    finally:
        if client is not None:
            client.shutdown()
        server.shutdown()


async def _overhead(preset: str, mode: str, microbatches: int, log: Callable[[str], None]) -> dict:
    from agora.server.node import NodeOptions, StageNode
    from agora.client.trainer import Trainer

    m = load_manifest(preset)
    m = m.with_overrides(stages=[m.model.n_layers // 2, m.model.n_layers - m.model.n_layers // 2])
    if mode == "dense":
        m = m.with_overrides(**DENSE_RESIDUAL)
    boot = make_dht()
    dhts, nodes = [boot], []
    try:
        for s in range(2):
            dht = make_dht(visible_maddrs(boot))
            dhts.append(dht)
            node = StageNode(m, s, dht, NodeOptions(stall_step_s=1e9))
            await node.start()
            nodes.append(node)
        trainer = Trainer(m, boot, shard=None)
        await trainer.start()
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, m.model.vocab_size, (m.batch.microbatch_size, m.model.seq_len + 1), generator=g)
                   for _ in range(microbatches + 1)]
        await trainer.send(batches[0])  # warm-up (first-call allocations, connection set-up)
        walls, computes = [], []
        for b in batches[1:]:
            busy0 = sum(n.counters.busy_s for n in nodes)
            t0 = time.perf_counter()
            await trainer.send(b)
            walls.append(time.perf_counter() - t0)
            computes.append(sum(n.counters.busy_s for n in nodes) - busy0)
        trainer.close()
        share = [(w - c) / w for w, c in zip(walls, computes)]
        log(f"[rpc] {preset} {mode}: microbatch {1e3 * statistics.median(walls):.0f} ms, "
            f"outside compute {100 * statistics.median(share):.1f}%")
        return {"preset": preset, "residual": mode, "microbatches": microbatches,
                "wall_ms_p50": 1e3 * statistics.median(walls), "compute_ms_p50": 1e3 * statistics.median(computes),
                "overhead_ms_p50": 1e3 * statistics.median(w - c for w, c in zip(walls, computes)),
                "overhead_share_p50": statistics.median(share)}
    finally:
        for node in nodes:
            await node.stop()
        for dht in dhts:
            dht.shutdown()


def run(out: Path, repeats: int = 20, microbatches: int = 10, log: Callable[[str], None] = print) -> dict:
    hops = asyncio.run(_hop_rtts(repeats, log))
    overhead = [asyncio.run(_overhead("small", mode, microbatches, log)) for mode in ("subspace", "dense")]
    md = markdown_table(
        ["preset", "boundary", "shape", "bytes each way", "p50 ms", "p95 ms"],
        [[h["preset"], h["mode"], "x".join(map(str, h["shape"])), h["bytes_each_way"], h["p50_ms"], h["p95_ms"]]
         for h in hops],
    )
    md += "\n\n" + markdown_table(
        ["preset", "residual", "microbatch p50 ms", "compute p50 ms", "outside compute p50 ms", "share"],
        [[o["preset"], o["residual"], o["wall_ms_p50"], o["compute_ms_p50"], o["overhead_ms_p50"],
          f"{100 * o['overhead_share_p50']:.1f}%"] for o in overhead],
    )
    result = {"hops": hops, "overhead": overhead}
    write_result(out, "rpc", result, md)
    log(md)
    return result

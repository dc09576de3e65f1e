"""Prometheus /metrics of a live node: counters read at scrape time, histograms fed by the observer hooks."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from types import SimpleNamespace

import psutil
import torch
from prometheus_client.parser import text_string_to_metric_families

from agora.config import load_manifest
from agora.server.observers import Observers
from agora.ops.metrics import serve_node_metrics
from agora.client.trainer import Trainer
from swarm_util import leftover_children, local_swarm


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _batch(man, seed: int, b: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, man.model.vocab_size, (b, man.model.seq_len + 1), generator=g)


def test_node_metrics_grow_with_work():
    man = load_manifest("tiny")
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    async def main():
        async with local_swarm(man, [0, 1]) as (boot, peers, nodes):
            head, tail = nodes
            servers = [serve_node_metrics(n, 0, host="127.0.0.1") for n in nodes]
            try:
                trainer = Trainer(man, boot, shard=None)
                await trainer.start()
                await trainer.send(_batch(man, 1))
                first = [await asyncio.to_thread(scrape, s.url) for s in servers]
                for seed in (2, 3, 4):
                    await trainer.send(_batch(man, seed))
                # 32 samples >= the target batch of 16: every stage steps (a lone replica steps locally).
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and min(n.step for n in nodes) < 1:
                    await asyncio.sleep(0.2)
                second = [await asyncio.to_thread(scrape, s.url) for s in servers]
                trainer.close()
                return first, second, [n.step for n in nodes], [n.counters.tokens for n in nodes]
            finally:
                for s in servers:
                    s.close()
                assert not any(n.observers.observers(k) for n in (head, tail) for k in ("compute", "round"))  # close() detached its hooks

    first, second, steps, tokens = asyncio.run(main())
    h1, h2 = first[0], second[0]
    t1, t2 = first[1], second[1]

    # Counters read from the node at scrape time.
    assert h1[("agora_tokens_total", ())] == 8 * man.model.seq_len
    assert h2[("agora_tokens_total", ())] == tokens[0] == 4 * 8 * man.model.seq_len
    fwd = ("agora_microbatches_total", (("kind", "forward"),))
    bwd = ("agora_microbatches_total", (("kind", "backward"),))
    assert (h1[fwd], h2[fwd], h2[bwd]) == (1, 4, 4)
    assert (t1[fwd], t2[fwd], t2[bwd]) == (1, 4, 4)
    sent = ("agora_boundary_payload_bytes_total", (("boundary", "0->1"), ("direction", "sent")))
    got = ("agora_boundary_payload_bytes_total", (("boundary", "0->1"), ("direction", "received")))
    assert 0 < h1[sent] < h2[sent]
    assert t2[got] == h2[sent]  # both ends of the boundary count the same payload
    assert ("agora_queue_depth", ()) in h2
    assert h2[("agora_peer_state", (("agora_peer_state", "serving"),))] == 1
    assert h1[("agora_optimizer_step", ())] == 0
    assert h2[("agora_optimizer_step", ())] == steps[0] >= 1
    assert t2[("agora_optimizer_step", ())] == steps[1] >= 1
    assert h2[("agora_averaging_rounds_total", (("outcome", "local"),))] == steps[0]  # lone replica: local steps
    assert ("agora_loss_ema", ()) in t2 and ("agora_loss_ema", ()) not in h2  # only the tail sees the loss
    assert h2[("agora_acknowledged_results_total", (("downstream_peer", tail_id(second[1])),))] == 4

    # Histograms fed by the observer hooks.
    fcount = ("agora_compute_seconds_count", (("kind", "forward"),))
    assert (h1[fcount], h2[fcount]) == (1, 4)
    assert h2[("agora_compute_seconds_count", (("kind", "backward"),))] == 4
    assert h2[("agora_compute_seconds_sum", (("kind", "forward"),))] > 0
    assert h2[("agora_averaging_round_seconds_count", (("outcome", "ok"),))] == steps[0]

    # Where the node computes, and its memory: no device peak on a CPU (its tensors are in the resident set).
    compute = next(dict(labels) for (name, labels) in h2 if name == "agora_compute_info")
    assert compute == {"device": "cpu", "precision": "fp32", "backward": "stash", "offload_optimizer": "False",
                       "checkpoint_blocks": "False", "optimizer_kernel": "single"}
    assert h2[("agora_agreed_within_tolerance_total", ())] == 0  # bit-identical replicas (one kernel, one device)
    assert h2[("agora_host_peak_rss_bytes", ())] >= h2[("agora_host_rss_bytes", ())] > 50 * 2**20
    assert ("agora_device_peak_bytes", ()) not in h2

    # Nothing left running: hivemind's DHT processes and p2p daemons of this test are gone.
    left = leftover_children(before)
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"


def tail_id(tail_scrape: dict) -> str:
    return next(dict(labels)["peer_id"] for (name, labels) in tail_scrape if name == "agora_peer_info")


def test_histograms_subscribe_before_the_node_starts():
    """``agora node --metrics-port`` serves metrics before ``node.start()`` creates ``node.sync``: the histograms
    subscribe to the node's events, which need no sync."""
    node = SimpleNamespace(observers=Observers(), sync=None)
    server = serve_node_metrics(node, 0)
    try:
        assert len(node.observers.observers("compute")) == 1
        assert len(node.observers.observers("round")) == 1
        node.observers.emit("round", True, 0.3, 2)
        node.observers.emit("round", False, 7.0, 1)
        node.observers.emit("compute", "forward", 0.002, 512)
        count = server.registry.get_sample_value
        assert count("agora_averaging_round_seconds_count", {"outcome": "ok"}) == 1
        assert count("agora_averaging_round_seconds_count", {"outcome": "failed"}) == 1
        assert count("agora_compute_seconds_count", {"kind": "forward"}) == 1
    finally:
        server.close()
    assert node.observers.observers("compute") == [] and node.observers.observers("round") == []

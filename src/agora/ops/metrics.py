"""Prometheus ``/metrics`` for one stage node.

Two kinds of numbers, fed two different ways so that a node pays (almost) nothing for being observed:

* Counters and gauges the node already keeps (``node.counters``, ``stats_in``/``stats_out``, ``step``, ``state``,
  ``loss_ema``, the averager's round counts) are *read at scrape time* by a custom collector. Nothing is added to
  the hot path, and the values can never drift from what the node itself reports in its DHT record.
* Latency distributions cannot be reconstructed from totals, so forward/backward times and averaging-round times
  are recorded into histograms by subscribing to the node's ``observers`` ("compute" and "round" events). Metrics
  may be served before ``node.start()`` (so a slow start is observable): the subscriptions do not need a sync.

Each server owns a private ``CollectorRegistry``: several nodes in one process (tests) never share or collide on
metric names, and the process-global registry's default collectors (GC, platform) stay out of node metrics.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    StateSetMetricFamily,
)
from prometheus_client.registry import Collector

from agora.net.records import PeerState
from agora.server.node import StageNode

# Compute on a tiny CPU model takes milliseconds; a stage of an 8B model on a slow GPU takes seconds.
COMPUTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

MICROBATCH_KINDS = ("forward", "backward", "eval", "failed", "retried", "rejected")


def boundary_names(node: StageNode) -> tuple[str, Optional[str]]:
    """(upstream boundary, downstream boundary) labels, e.g. ``("0->1", "1->2")``; the head's upstream is the trainer."""
    s = node.stage_index
    upstream = "trainer->0" if node.is_head else f"{s - 1}->{s}"
    downstream = None if node.is_tail else f"{s}->{s + 1}"
    return upstream, downstream


class NodeCollector(Collector):
    """Reads the node's own counters at scrape time (one dict copy per scrape; nothing on the hot path)."""

    def __init__(self, node: StageNode):
        self.node = node

    def collect(self) -> Iterator[Any]:
        n = self.node
        labels = {"run_id": n.manifest.run_id, "manifest_hash": n.manifest.hash,
                  "peer_id": n.peer_id, "stage": str(n.stage_index)}
        yield InfoMetricFamily("agora_peer", "Identity of this peer: run, manifest, peer id, stage.", value=labels)
        yield from self._microbatches()
        yield from self._boundaries()
        yield from self._gauges()
        yield from self._incoming()
        yield from self._averaging()

    def _microbatches(self) -> Iterator[Any]:
        c = self.node.counters

        yield CounterMetricFamily("agora_tokens", "Training tokens this stage computed a forward for.",
                                  value=c.tokens)
        mb = CounterMetricFamily("agora_microbatches", "Microbatches by what happened to them on this stage.",
                                 labels=["kind"])
        for kind in MICROBATCH_KINDS:
            mb.add_metric([kind], getattr(c, kind))
        yield mb
        rejected = CounterMetricFamily("agora_rejected_microbatches", "Requests refused by validation, by code.",
                                       labels=["code"])
        for code, count in sorted(dict(c.rejected_by_code).items()):
            rejected.add_metric([code], count)
        yield rejected
        yield CounterMetricFamily("agora_compute_busy_seconds", "Seconds the compute thread spent on fwd/bwd.",
                                  value=c.busy_s)

    def _boundaries(self) -> Iterator[Any]:
        n = self.node
        payload = CounterMetricFamily("agora_boundary_payload_bytes",
                                      "Tensor payload bytes per pipeline boundary and direction (from this peer).",
                                      labels=["boundary", "direction"])
        wire = CounterMetricFamily("agora_boundary_wire_bytes",
                                   "Serialized protobuf bytes per pipeline boundary and direction.",
                                   labels=["boundary", "direction"])
        calls = CounterMetricFamily("agora_boundary_calls", "RPCs per pipeline boundary (served or made).",
                                    labels=["boundary"])
        upstream, downstream = boundary_names(n)
        for boundary, stats in ((upstream, n.stats_in), (downstream, n.stats_out)):
            if boundary is None:
                continue
            payload.add_metric([boundary, "sent"], stats.payload_bytes_sent)
            payload.add_metric([boundary, "received"], stats.payload_bytes_received)
            wire.add_metric([boundary, "sent"], stats.wire_bytes_sent)
            wire.add_metric([boundary, "received"], stats.wire_bytes_received)
            calls.add_metric([boundary], stats.calls)
        yield payload
        yield wire
        yield calls

    def _gauges(self) -> Iterator[Any]:
        n = self.node
        yield GaugeMetricFamily("agora_queue_depth", "Jobs waiting for or running on the compute thread.",
                                value=n.queue)
        yield GaugeMetricFamily("agora_inflight_microbatches", "Microbatches between their forward and backward.",
                                value=n.inflight)
        yield GaugeMetricFamily("agora_throughput_tokens_per_second", "Compute throughput (EMA), as announced.",
                                value=n.runtime.throughput)
        yield GaugeMetricFamily("agora_optimizer_step", "Optimizer steps taken by this stage.", value=n.step)
        yield GaugeMetricFamily("agora_utilisation", "Compute seconds over seconds alive (forward, backward, "
                                "steps; the rest is averaging and waiting).", value=n.utilisation())
        yield GaugeMetricFamily("agora_accumulated_samples", "Samples accumulated toward the next step.",
                                value=n.runtime.samples)
        if n.is_tail and not math.isnan(n.runtime.loss_ema):
            yield GaugeMetricFamily("agora_loss_ema", "Training loss (EMA) seen by the tail stage.",
                                    value=n.runtime.loss_ema)
        curvature = n.runtime.curvature if n.runtime is not None else None
        if curvature is not None:
            c = curvature.summary()
            yield GaugeMetricFamily("agora_curvature_lambda", "Top eigenvalue of this stage's Adam-preconditioned "
                                    "Hessian, last measurement (NaN before the first).",
                                    value=c["value"] if c["value"] is not None else float("nan"))
            yield GaugeMetricFamily("agora_curvature_lr_lambda", "Learning rate x that eigenvalue; above "
                                    "agora_curvature_threshold the step is unstable.",
                                    value=c["lr_times_value"] if c["lr_times_value"] is not None else float("nan"))
            yield GaugeMetricFamily("agora_curvature_threshold", "Stability threshold (2 + 2 beta1) / (1 - beta1).",
                                    value=c["threshold"])
            yield CounterMetricFamily("agora_curvature_alarms", "Curvature measurements above the threshold.",
                                      value=c["alarms"])
        if n.runtime is not None and n.manifest.training.warmup_depth is not None:
            yield GaugeMetricFamily("agora_warmup_active_blocks", "Architecture warm-up: blocks active now "
                                    "(global index below this).", value=n.runtime.stage.active_depth)
            yield GaugeMetricFamily("agora_warmup_clock", "Architecture warm-up: steps of its clock (optimizer steps "
                                    "but those a curvature-driven warm-up held).", value=n.runtime.warmup_clock)
            if n.sync is not None:
                yield CounterMetricFamily("agora_warmup_held_steps", "Steps a curvature-driven warm-up held its "
                                          "clock (lr x lambda above its limit).",
                                          value=n.sync.warmup_brake.held_steps)
        frames = n.runtime.frames if n.runtime is not None else None
        if frames is not None:  # UPM (server/upm.py)
            yield GaugeMetricFamily("agora_upm_epoch_in", "UPM: frame epoch of this stage's input boundary.",
                                    value=frames.epoch_in)
            yield GaugeMetricFamily("agora_upm_epoch_out", "UPM: frame epoch of this stage's output boundary.",
                                    value=frames.epoch_out)
            yield CounterMetricFamily("agora_upm_rotations_applied", "UPM: boundary rotations applied here.",
                                      value=frames.applied)
            yield CounterMetricFamily("agora_upm_rotations_late", "UPM: rotations applied after their step had "
                                      "passed (the replica is then repaired by a state download).", value=frames.late)
        if n.runtime is not None:
            mem = n.runtime.memory()
            yield InfoMetricFamily("agora_compute", "Where and how this peer computes its stage.",
                                   value={k: str(mem[k]) for k in ("device", "precision", "backward",
                                                                   "offload_optimizer", "checkpoint_blocks",
                                                                   "optimizer_kernel")})
            if mem["device_peak_bytes"] is not None:
                yield GaugeMetricFamily("agora_device_peak_bytes", "Most device memory held by tensors at once since "
                                        "the node started (CUDA allocator).", value=mem["device_peak_bytes"])
                yield GaugeMetricFamily("agora_device_allocated_bytes", "Device memory held by tensors now.",
                                        value=mem["device_allocated_bytes"])
            yield GaugeMetricFamily("agora_host_peak_rss_bytes", "Largest resident set of this process so far.",
                                    value=mem["host_peak_rss_bytes"])
            if mem["host_rss_bytes"] is not None:
                yield GaugeMetricFamily("agora_host_rss_bytes", "Resident set of this process now.",
                                        value=mem["host_rss_bytes"])
        yield StateSetMetricFamily("agora_peer_state", "Lifecycle state of this peer.",
                                   value={s.value: n.state == s for s in PeerState})

    def _incoming(self) -> Iterator[Any]:
        state = self.node.incoming.snapshot()
        yield GaugeMetricFamily("agora_incoming_budget_bytes", "Bytes of incoming requests this node may buffer "
                                "(all peers together; net/admission.py).", value=state["budget_bytes"])
        yield GaugeMetricFamily("agora_incoming_buffered_bytes", "Bytes of incoming requests buffered now.",
                                value=state["buffered_bytes"])
        yield GaugeMetricFamily("agora_incoming_peak_buffered_bytes", "Most bytes of incoming requests buffered at "
                                "once since the node started.", value=state["peak_buffered_bytes"])
        yield GaugeMetricFamily("agora_incoming_streams", "Incoming RPC streams open now.",
                                value=state["open_streams"])
        refused = CounterMetricFamily("agora_incoming_refused", "Incoming streams refused or cut at a limit, by "
                                      "reason (busy_*, too_slow, too_large_for_budget).", labels=["reason"])
        for reason, count in sorted(state["refused"].items()):
            refused.add_metric([reason], count)
        yield refused

    def _averaging(self) -> Iterator[Any]:
        n = self.node
        sync = n.sync
        if sync is not None:
            rounds = CounterMetricFamily("agora_averaging_rounds",
                                         "Optimizer steps by how their gradient was obtained.", labels=["outcome"])
            rounds.add_metric(["ok"], sync.rounds_ok)
            rounds.add_metric(["failed"], sync.rounds_failed)
            rounds.add_metric(["local"], sync.local_steps)
            yield rounds
            yield CounterMetricFamily("agora_partial_allreduce_rounds", "Failed rounds whose all-reduce hivemind "
                                      "finished with part of the average missing (a reducer or sender timed out).",
                                      value=sync.partial_rounds)
            yield CounterMetricFamily("agora_state_resyncs", "State downloads from replicas.", value=sync.resyncs)
            clipping = CounterMetricFamily("agora_clip_steps", "Steps by how their gradient was clipped (global: by "
                                           "every stage's norm; fallback: another stage's norm did not arrive "
                                           "within the clip wait, clipped by our own).", labels=["how"])
            clipping.add_metric(["global"], sync.clipper.global_steps)
            clipping.add_metric(["fallback"], sync.clipper.fallbacks)
            yield clipping
            yield CounterMetricFamily("agora_realigned_steps", "Partial steps taken because the rest of the batch "
                                      "left with a replica that moved or died (the other stages had stepped).",
                                      value=sync.realigned_steps)
            yield CounterMetricFamily("agora_agreed_within_tolerance", "Replicas at our step found with another "
                                      "fingerprint but sampled parameters within averaging.agreement_tolerance "
                                      "(rounding of another device or optimizer kernel; no download).",
                                      value=sync.tolerated)
            if sync.consensus_distance is not None:
                yield GaugeMetricFamily("agora_consensus_distance", "Relative spread of the stage replicas' "
                                        "parameters at one step, from seeded samples (0: identical).",
                                        value=sync.consensus_distance)
            if hasattr(sync, "outer_seconds"):  # DiLoCo
                yield CounterMetricFamily("agora_outer_rounds_alone", "DiLoCo outer steps taken without partners "
                                          "(none alive, or the round failed).", value=sync.outer_rounds_alone)
                yield CounterMetricFamily("agora_outer_round_seconds", "Seconds DiLoCo outer rounds blocked this "
                                          "replica.", value=sync.outer_seconds)
            if hasattr(sync, "blocking_bytes"):  # gossip
                exchanged = CounterMetricFamily("agora_gossip_bytes_sent", "Gossip exchange bytes this replica "
                                                "sent, by kind (blocking: phase end; background: Mix1).",
                                                labels=["kind"])
                exchanged.add_metric(["blocking"], sync.blocking_bytes)
                exchanged.add_metric(["background"], sync.background_bytes)
                yield exchanged
                yield CounterMetricFamily("agora_gossip_exchanges_failed", "Pairwise gossip exchanges that found "
                                          "no partner in time, or whose pair held different references.",
                                          value=sync.exchanges_failed)
                yield CounterMetricFamily("agora_gossip_exchanges_compressed", "Pairwise gossip exchanges sent as "
                                          "the difference from the pair's reference, compressed (averaging.codec).",
                                          value=sync.exchanges_compressed)
                yield CounterMetricFamily("agora_gossip_reference_mismatches", "Pairwise gossip exchanges discarded "
                                          "because the pair held different references.",
                                          value=sync.reference_mismatches)
            yield CounterMetricFamily("agora_averaging_bytes_sent",
                                      "All-reduce payload bytes this replica sent to its round partners.",
                                      value=sync.bytes_sent)

        acks = CounterMetricFamily("agora_acknowledged_results",
                                   "Results this peer received from each downstream peer (receiver-side acks).",
                                   labels=["downstream_peer"])
        for peer, count in sorted(dict(n.acks).items()):
            acks.add_metric([peer], count)
        yield acks


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` stops it and detaches its observers from the node."""

    node: StageNode
    registry: CollectorRegistry
    host: str
    port: int
    _httpd: Any
    _thread: threading.Thread
    _hooks: "_Hooks"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._hooks.close()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Hooks:
    """Histograms fed by the node's "compute" and "round" events."""

    def __init__(self, node: StageNode, registry: CollectorRegistry):
        self.node = node
        self.compute = Histogram("agora_compute_seconds", "Forward/backward compute time of one microbatch.",
                                 ["kind"], buckets=COMPUTE_BUCKETS, registry=registry)
        self.rounds = Histogram("agora_averaging_round_seconds",
                                "Duration of one optimizer step (all-reduce included), by outcome.",
                                ["outcome"], buckets=ROUND_BUCKETS, registry=registry)
        node.observers.subscribe("compute", self.on_compute)
        node.observers.subscribe("round", self.on_round)

    def on_compute(self, kind: str, seconds: float, tokens: int) -> None:
        self.compute.labels(kind).observe(seconds)

    def on_round(self, ok: bool, seconds: float, group_size: int) -> None:
        self.rounds.labels("ok" if ok else "failed").observe(seconds)

    def close(self) -> None:
        self.node.observers.unsubscribe("compute", self.on_compute)
        self.node.observers.unsubscribe("round", self.on_round)


def serve_node_metrics(node: StageNode, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve Prometheus metrics of ``node`` at ``http://host:port/metrics`` (``port=0``: any free port).

    The default host is loopback: metrics name peers and volumes, so exposing them is an explicit choice
    (``agora node --host 0.0.0.0`` binds metrics to the same address as the node).
    """
    registry = CollectorRegistry(auto_describe=False)
    hooks = _Hooks(node, registry)
    registry.register(NodeCollector(node))
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except Exception:
        hooks.close()
        raise
    return MetricsServer(node, registry, host, int(httpd.server_port), httpd, thread, hooks)

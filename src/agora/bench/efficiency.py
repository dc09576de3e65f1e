"""``agora bench efficiency``: the swarm against the centralized baseline, side by side in one run.

Same manifest, data and token budget:
  (a) centralized: ``train-local`` with every core of the machine,
  (b) the local swarm (stages x replicas processes + trainer + bootstrap) on the same cores.
Reported: tokens per pooled CPU-second (every process of the swarm counted, hivemind's DHT/averager processes and
libp2p daemons included), their ratio, wall-clock tokens/s, and validation loss at equal tokens.

With ``link_mbps``, the swarm runs again with every peer's uplink capped, once with subspace and once with dense
boundaries, to show what compression does to throughput on slow links. The cap is kernel-enforced (each peer in its
own network namespace, ``tc tbf``, hivemind's DHT and averaging traffic capped too) when running as root with
namespaces, else the in-transport throttle (tensor RPCs only); ``link_backend`` can force either, and the JSON
records which one ran and why, since the two are not the same experiment.

All runs share the machine's cores, so the pooled CPU-second ratio is the fair efficiency figure; wall-clock
numbers are reported too but depend on how many processes compete for two cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from agora.bench.common import markdown_table, write_result
from agora.lab.demo import (DemoOptions, LinkOptions, LinkPlan, StopRule, SwarmShape, demo_manifest, plan_links,
                             run_demo)
from agora.lab.train_local import train_local


@dataclass(frozen=True)
class EfficiencyOptions:
    """The compared runs: ``preset`` trained ``steps`` optimizer steps, the swarm as ``stages x replicas`` stage
    nodes and one trainer keeping ``in_flight`` microbatches in flight, replicas averaged as ``averaging`` (a spec,
    None: the preset's). With ``link_mbps``, also the capped-link runs (``capped_steps`` steps each, default
    ``steps``) with the link backend ``link_backend`` (auto, netns or transport)."""

    preset: str = "small"
    steps: int = 20
    stages: int = 3
    replicas: int = 2
    in_flight: int = 4
    link_mbps: Optional[float] = None
    capped_steps: Optional[int] = None
    link_backend: str = "auto"
    averaging: Optional[str] = None


SWARM_TIMEOUT_S = 3600  # each swarm run gives up after this long


def capped_runs(out: Path, options: EfficiencyOptions, backend: str, log: Callable[[str], None] = print) -> dict:
    """The swarm with every peer's link capped at ``options.link_mbps``, once with subspace and once with dense
    boundaries; ``backend``: the link backend already planned (see :func:`agora.lab.demo.plan_links`).

    No validation pass: only throughput is compared, and at a few Mbit/s a dense trainer's last validation
    microbatches outlast the demo's stop window (it is then killed and its token count lost).
    """
    link_mbps = options.link_mbps
    capped = {}
    for residual in ("subspace", "dense"):
        log(f"[efficiency] swarm, {residual} boundaries, links capped at {link_mbps:g} Mbit/s ({backend})")
        s = run_demo(DemoOptions(
            out=Path(out) / f"swarm-{residual}-{link_mbps:g}mbit",
            shape=_swarm_shape(options, residual=residual, val_batches=0),
            stop=StopRule(steps=options.capped_steps or options.steps, timeout=SWARM_TIMEOUT_S),
            link=LinkOptions(mbps=link_mbps, backend=backend), live=False))
        capped[residual] = {"tokens_per_s": s["tokens_per_s"], "tokens": s["tokens"], "wall_s": s["wall_s"],
                            "finished": s["finished"], "bytes_per_boundary": s["bytes_per_boundary"],
                            "link_backend": s["link"]["backend"], "rounds_ok": s["rounds_ok"],
                            "rounds_failed": s["rounds_failed"]}
    return capped


def run(out: Path, options: Optional[EfficiencyOptions] = None, log: Callable[[str], None] = print) -> dict:
    """Centralized, then the swarm, then (with ``link_mbps``) the capped-link swarms; writes ``OUT/result.json``
    and ``OUT/result.md``."""
    opts = options or EfficiencyOptions()
    out = Path(out)
    plan = plan_links(opts.link_mbps, 0.0, opts.link_backend) if opts.link_mbps is not None else None  # fail early
    manifest = demo_manifest(opts.preset, opts.stages, averaging=opts.averaging)
    scheme = _scheme_label(manifest.averaging)
    cores = os.cpu_count() or 1
    log(f"[efficiency] centralized: {opts.preset}, {opts.steps} steps, {cores} threads")
    central = train_local(manifest, opts.steps, out / "centralized", val_batches=4, threads=cores)
    log(f"[efficiency] swarm: {opts.stages} stages x {opts.replicas} replicas, {opts.steps} steps, {scheme} averaging")
    swarm = run_demo(DemoOptions(out=out / "swarm", shape=_swarm_shape(opts),
                                 stop=StopRule(steps=opts.steps, timeout=SWARM_TIMEOUT_S), live=False))
    md = _comparison_markdown(central, swarm, scheme)
    result = {"preset": opts.preset, "steps": opts.steps, "stages": opts.stages, "replicas": opts.replicas,
              "cores": cores, "averaging": manifest.averaging.model_dump(mode="json"),
              "centralized": {k: central[k] for k in _CENTRAL_FIELDS}, "swarm": {k: swarm[k] for k in _SWARM_FIELDS},
              "ratio_tokens_per_cpu_s": swarm["tokens_per_cpu_s"] / central["tokens_per_cpu_s"],
              "ratio_tokens_per_s": swarm["tokens_per_s"] / central["tokens_per_s"]}
    if plan is not None:
        md += _add_capped_runs(out, opts, plan, swarm, result, log)
    write_result(out, "efficiency", result, md)
    log(md)
    return result


_CENTRAL_FIELDS = ("tokens", "wall_s", "cpu_s", "tokens_per_s", "tokens_per_cpu_s", "val_loss")
_SWARM_FIELDS = ("tokens", "wall_s", "cpu_s_total", "tokens_per_s", "tokens_per_cpu_s", "val_loss", "microbatches",
                 "cpu_s_by_process", "finished", "rounds_ok", "rounds_failed", "averaging_bytes_sent")


def _swarm_shape(opts: EfficiencyOptions, residual: Optional[str] = None, val_batches: int = 4) -> SwarmShape:
    return SwarmShape(preset=opts.preset, stages=opts.stages, replicas=opts.replicas, in_flight=opts.in_flight,
                      residual=residual, averaging=opts.averaging, val_batches=val_batches)


def _scheme_label(a) -> str:
    """The manifest's averaging section ``a`` in a few words, e.g. ``powersgd rank 4``."""
    return {"full": "full", "powersgd": f"powersgd rank {a.rank}",
            "sparse": f"sparse rho {a.rho:g} every {a.every}"}[a.scheme]


def _comparison_markdown(central: dict, swarm: dict, scheme: str) -> str:
    """The centralized and swarm runs side by side, then the averaging traffic and the ratios."""
    rows = [
        ["centralized", central["tokens"], central["wall_s"], central["cpu_s"], central["tokens_per_s"],
         central["tokens_per_cpu_s"], central["val_loss"]],
        ["swarm", swarm["tokens"], swarm["wall_s"], swarm["cpu_s_total"], swarm["tokens_per_s"],
         swarm["tokens_per_cpu_s"], swarm["val_loss"]],
    ]
    ratio = swarm["tokens_per_cpu_s"] / central["tokens_per_cpu_s"]
    wall_ratio = swarm["tokens_per_s"] / central["tokens_per_s"]
    md = markdown_table(["run", "tokens", "wall s", "pooled CPU s", "tokens/s", "tokens per CPU-s", "val loss"], rows)
    md += (f"\n\nReplica averaging: {scheme}, {swarm['averaging_bytes_sent']} all-reduce payload bytes sent by all "
           f"replicas in {swarm['rounds_ok']} successful rounds.")
    md += (f"\n\nswarm / centralized tokens per pooled CPU-second: **{ratio:.3f}**; wall-clock tokens/s ratio "
           f"{wall_ratio:.3f}. Validation loss ratio (swarm/centralized): "
           f"{(swarm['val_loss'] or float('nan')) / central['val_loss']:.4f}\n")
    return md


def _add_capped_runs(out: Path, opts: EfficiencyOptions, plan: LinkPlan, swarm: dict, result: dict,
                     log: Callable[[str], None]) -> str:
    """Run the capped-link swarms, add them to ``result`` (compared with the uncapped ``swarm``) and return
    their Markdown table."""
    capped = capped_runs(out, opts, plan.backend, log=log)
    for v in capped.values():
        v["vs_uncapped_swarm"] = v["tokens_per_s"] / swarm["tokens_per_s"]
    result["capped"] = {"link_mbps": opts.link_mbps, "link_backend": plan.backend, "link_backend_reason": plan.reason,
                        **capped}
    return "\n" + markdown_table(
        ["boundaries", "link", "backend", "tokens/s", "vs uncapped swarm"],
        [[k, f"{opts.link_mbps:g} Mbit/s", v["link_backend"], v["tokens_per_s"], f"{v['vs_uncapped_swarm']:.3f}"]
         for k, v in capped.items()],
    ) + "\n"

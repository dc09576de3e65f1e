"""The ``agora`` command line. Subcommands import their machinery lazily so ``agora --help`` stays instant."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Protocol Learning: train one model as a swarm.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that write JSON + Markdown results.")
app.add_typer(bench_app, name="bench")
console = Console(stderr=True)


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


@app.command("train-local")
def train_local_cmd(
    manifest: str = typer.Option("tiny", help="preset or YAML file"),
    steps: int = typer.Option(50, min=1),
    out: Path = typer.Option(Path("runs/local")),
    eval_every: int = typer.Option(0, help="validate every N steps (0: only at the end)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
) -> None:
    """Centralized baseline: train the whole model in this process; writes summary.json, loss.png, report.html."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from agora.train_local import train_local

    m = _manifest(manifest)
    with Progress(
        TextColumn("[bold]train-local"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"), TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("train", total=steps, loss="-", tps="-")

        def on_step(rec: dict) -> None:
            progress.update(task, advance=1, loss=f"{rec['loss']:.3f}", tps=f"{rec['tokens'] / rec['wall_s']:.0f}")

        summary = train_local(m, steps, out, eval_every=eval_every, threads=threads, on_step=on_step)
    console.print(
        f"done: {summary['tokens']} tokens in {summary['wall_s']:.1f}s ({summary['tokens_per_s']:.0f} tok/s), "
        f"final train loss {summary['train_loss'][-1]:.3f}, val loss {summary['val_loss']:.3f} -> {out}/summary.json"
    )


@bench_app.command("compression")
def bench_compression(
    out: Path = typer.Option(Path("bench-out/compression")),
    tokens: int = typer.Option(400_000, help="token budget of each training run (dense and subspace)"),
    preset: str = typer.Option("small"),
) -> None:
    """Bytes per token per boundary (dense vs subspace) and validation loss at equal tokens on ``small``."""
    from agora.bench.compression import run

    result = run(out, token_budget=tokens, preset=preset, log=console.print)
    print(json.dumps(result["bytes"], indent=2))


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())

"""Shared output helpers for benchmarks: every benchmark writes machine-readable JSON and a Markdown table."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch


def environment() -> dict:
    """Where a result was measured: date, Python and torch versions, torch CPU threads, machine type."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table, floats shown with 4 significant digits."""
    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(out: Path, name: str, result: dict, markdown: str) -> None:
    """``OUT/result.json`` (``result`` headed by the benchmark's ``name`` and the environment) and ``OUT/result.md``
    (``markdown`` under the title ``agora bench NAME``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "environment": environment(), **result}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    (out / "result.md").write_text(f"# agora bench {name}\n\n{markdown}\n")

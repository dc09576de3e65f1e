"""Run reports: a loss plot (PNG) and a self-contained ``report.html`` (plots inlined as base64, no CDN)."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")  # headless: reports are written by servers and CI
import matplotlib.pyplot as plt  # noqa: E402


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def loss_figure(series: dict[str, tuple[list[float], list[float]]], title: str, xlabel: str = "tokens") -> bytes:
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, (xs, ys) in series.items():
        if xs:
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 40 else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig)


def line_figure(xs: list[float], ys: list[float], title: str, xlabel: str, ylabel: str) -> bytes:
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.plot(xs, ys)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _png(fig)


def bar_figure(labels: list[str], values: list[float], title: str, ylabel: str) -> bytes:
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.bar(labels, values, color="#4c78a8")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def write_html(out_dir: Path, title: str, facts: dict, plots: dict[str, bytes]) -> Path:
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in facts.items()
    )
    imgs = "".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(name)}</figcaption></figure>"
        for name, png in plots.items()
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:980px}}table{{border-collapse:collapse}}
th,td{{border-bottom:1px solid #ddd;padding:4px 10px;text-align:left}}figure{{display:inline-block;margin:1em}}</style>
</head><body><h1>{html.escape(title)}</h1><table>{rows}</table>{imgs}</body></html>"""
    path = Path(out_dir) / "report.html"
    path.write_text(page)
    return path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def write_local_report(summary: dict, out_dir: Path) -> None:
    hist = summary["history"]
    tokens = [h["tokens"] for h in hist]
    loss_png = loss_figure(
        {
            "train loss": (tokens, [h["loss"] for h in hist]),
            "val loss": ([e["tokens"] for e in summary["evals"]], [e["val_loss"] for e in summary["evals"]]),
        },
        f"{summary['run_id']} (centralized)",
    )
    (Path(out_dir) / "loss.png").write_bytes(loss_png)
    walls = [h["wall_s"] for h in hist]
    rate = [t / w if w > 0 else 0.0 for t, w in zip(tokens, walls)]
    write_html(
        out_dir,
        f"agora train-local: {summary['run_id']}",
        {k: summary[k] for k in ("manifest_hash", "residual", "steps", "tokens", "wall_s", "cpu_s", "tokens_per_s",
                                 "val_loss", "parameters", "flops_per_token")},
        {"loss vs tokens": loss_png, "tokens/s over time": line_figure(walls, rate, "throughput", "wall s", "tokens/s")},
    )


def write_swarm_report(summary: dict, out_dir: Path, centralized: Optional[dict] = None) -> None:
    """Loss vs tokens (swarm, and centralized when given), tokens/s over time, stage utilisation, boundary bytes."""
    curve = summary.get("loss_curve", [])
    series = {"swarm train loss": ([p["tokens"] for p in curve], [p["loss"] for p in curve])}
    if centralized:
        series["centralized train loss"] = (
            [h["tokens"] for h in centralized["history"]],
            [h["loss"] for h in centralized["history"]],
        )
    loss_png = loss_figure(series, f"{summary.get('run_id', '')} (swarm)")
    (Path(out_dir) / "loss.png").write_bytes(loss_png)
    plots = {"loss vs tokens": loss_png}
    if curve:
        plots["tokens/s over time"] = line_figure(
            [p["wall_s"] for p in curve],
            [p["tokens"] / p["wall_s"] if p["wall_s"] > 0 else 0.0 for p in curve],
            "swarm throughput",
            "wall s",
            "tokens/s",
        )
    util = summary.get("stage_utilisation", {})
    if util:
        plots["per-stage utilisation"] = bar_figure(list(util), list(util.values()), "busy share of wall time", "share")
    by_boundary = summary.get("bytes_per_boundary", {})
    if by_boundary:
        plots["bytes per boundary"] = bar_figure(list(by_boundary), list(by_boundary.values()), "bytes sent", "bytes")
    curvature = {k: v for k, v in summary.get("curvature_per_stage", {}).items() if v.get("lr_times_value") is not None}
    if curvature:
        threshold = next(iter(curvature.values()))["threshold"]
        plots["curvature per stage"] = bar_figure(
            [f"stage {k} ({v['alarms']} alarms)" for k, v in curvature.items()],
            [v["lr_times_value"] for v in curvature.values()],
            f"lr x top preconditioned Hessian eigenvalue (unstable above {threshold:.0f})", "lr x lambda")
    facts = {k: v for k, v in summary.items() if not isinstance(v, (list, dict))}
    write_html(out_dir, f"agora demo: {summary.get('run_id', '')}", facts, plots)

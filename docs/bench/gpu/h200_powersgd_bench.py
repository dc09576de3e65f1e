"""What replica averaging of one Agora-8B-shaped stage costs on a GPU: bytes per round and compute, full vs PowerSGD.

Why: on a CPU machine the gradients are small and the all-reduce's cost is dominated by process overhead; at 8B
shapes the question is whether PowerSGD's extra matrix products are cheap next to a forward+backward (measured by
``h200_stage_bench.py``: 51 ms for a subspace body stage) and how many bytes it saves. One replica runs every
PowerSGD step on real-size random gradients of the body stage's parameter shapes (the all-reduce itself is the
identity here: its cost is the bytes, reported separately).

Run (CUDA machine, repo root):  PYTHONPATH=src python docs/bench/gpu/h200_powersgd_bench.py OUTDIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from agora.compression.powersgd import PowerSGD
from agora.config import load_manifest


def body_stage_shapes(manifest, index: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a body stage, from the manifest alone (no weights are built)."""
    s, r = manifest.model, manifest.residual
    out_dim = r.k if r.mode == "subspace" else s.d_model
    hd = s.head_dim
    per_layer = [
        (s.n_heads * hd, s.d_model), (s.n_kv_heads * hd, s.d_model), (s.n_kv_heads * hd, s.d_model),
        (out_dim, s.n_heads * hd), (s.ffn_dim, s.d_model), (s.ffn_dim, s.d_model), (out_dim, s.ffn_dim),
        (s.d_model,), (s.d_model,),
    ]
    return per_layer * manifest.stages[index]


def timed(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sub = load_manifest("agora-8b")
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "runs": []}
    for manifest in (sub, sub.with_overrides(**{"residual.mode": "dense", "residual.k": None})):
        shapes = body_stage_shapes(manifest, 2)
        grads = [torch.randn(sh, device="cuda") * 1e-3 for sh in shapes]
        numel = sum(g.numel() for g in grads)
        full_s = timed(lambda: [g.double() for g in grads])  # what the full scheme hands to the all-reduce
        for rank in (4, 16):
            psgd = PowerSGD(shapes, rank, run_id=manifest.run_id, stage=2)
            step = [0]

            def one_round() -> None:
                step[0] += 1
                ps = psgd.compress_p(grads, step[0])
                p_hat = psgd.orthogonalize([p.double() for p in ps])  # replicas average P in float64
                qs = psgd.compute_q(p_hat)
                psgd.assemble(psgd.decompress(p_hat, [q.double() for q in qs]), psgd.passthrough_tensors(grads))

            seconds = timed(one_round)
            row = {"mode": manifest.residual.mode, "params_M": round(numel / 1e6, 1), "rank": rank,
                   "full_fp64_MB": round(numel * 8 / 1e6, 1), "powersgd_fp64_MB": round(psgd.numel_sent() * 8 / 1e6, 2),
                   "bytes_ratio": round(numel / psgd.numel_sent(), 1), "powersgd_round_ms": round(seconds * 1e3, 2),
                   "fp64_cast_ms": round(full_s * 1e3, 2),
                   "full_link_s_at_100mbps": round(numel * 8 * 8 / 1e8, 1),
                   "powersgd_link_s_at_100mbps": round(psgd.numel_sent() * 8 * 8 / 1e8, 3)}
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
        del grads
        torch.cuda.empty_cache()
    (out / "h200_powersgd_bench.json").write_text(json.dumps(report, indent=1))
    lines = [f"PowerSGD on {report['device']} ({report['date']}, torch {report['torch']}): one agora-8b body stage "
             f"(5 layers), per replica per optimizer step", "",
             "| residual | params | rank | full fp64 payload | PowerSGD payload | ratio | PowerSGD compute | full at 100 Mbit/s | PowerSGD at 100 Mbit/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['mode']} | {r['params_M']}M | {r['rank']} | {r['full_fp64_MB']} MB | {r['powersgd_fp64_MB']} MB "
                     f"| {r['bytes_ratio']}x | {r['powersgd_round_ms']} ms | {r['full_link_s_at_100mbps']} s | "
                     f"{r['powersgd_link_s_at_100mbps']} s |")
    (out / "h200_powersgd_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out/gpu")

"""One GPU, real shapes: how long an Agora-8B-shaped stage computes, against how long its boundary takes to send.

Why this and not a swarm: the GPU machine has no network peers, and the question the swarm design rests on is a
per-stage one. A pipeline stage stays busy only if sending one microbatch's boundary takes less time than
computing it. This measures, on the real ``agora-8b`` stage shapes (d=4096, seq 4096, GQA 32/8, SwiGLU 14336),
the forward+backward time of a head, a body and a tail stage in ``dense`` and ``subspace`` (k=40) modes, bf16
autocast over fp32 weights, plus the exactness of the subspace boundary on the GPU. Link times are computed from
the measured wire bytes (``agora.wire``) at a given rate; nothing here is a projection of compute.

Run (on a CUDA machine, from the repo root):  PYTHONPATH=src python docs/bench/gpu/h200_stage_bench.py OUTDIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from agora.config import load_manifest
from agora.model import Stage, count_parameters
from agora.wire import bytes_per_token, compress, decompress

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, vendor datasheet
LINKS_MBPS = (100.0, 1000.0)


def uplink(is_head: bool, is_tail: bool, manifest, tokens: int, seconds: float) -> dict:
    """Every byte one stage uploads per microbatch on its one uplink, and compute / link time per rate: a head
    sends activations downstream; a body sends activations downstream *and* the gradient of its input upstream; a
    tail sends only that gradient (coordinates' shape, no token ids)."""
    shape = manifest.model
    per_tok = bytes_per_token(shape.d_model, manifest.residual.mode, manifest.residual.k, "bf16")
    up = (0 if is_tail else per_tok) + (0 if is_head else per_tok - 4)
    res = {"wire_bytes_per_microbatch": (0 if is_tail else per_tok) * tokens,
           "uplink_bytes_per_microbatch": up * tokens}
    for mbps in LINKS_MBPS:
        link_s = up * tokens * 8 / (mbps * 1e6)
        res[f"link_s_at_{int(mbps)}mbps"] = round(link_s, 4)
        res[f"compute_over_link_at_{int(mbps)}mbps"] = round(seconds / link_s, 2)
    return res


def timed(fn, warmup: int = 2, iters: int = 8) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000.0 / iters


def matmul_ceiling() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s = timed(lambda: a @ b, warmup=3, iters=10)
    return 2 * 8192**3 / s / 1e12


def stage_flops(manifest, index: int, tokens: int) -> float:
    """Training FLOPs of one microbatch through stage ``index``: 6 x matmul parameters + causal attention."""
    shape = manifest.model
    params = count_parameters(manifest)["per_stage"][index]
    if index == 0:
        params -= shape.vocab_size * (manifest.residual.k if manifest.residual.mode == "subspace" else shape.d_model)
    layers = manifest.stages[index]
    attention = 6 * layers * shape.seq_len * shape.d_model  # per token, as agora.model.flops_per_token counts it
    return tokens * (6.0 * params + attention)


def bench_stage(manifest, index: int, batch: int) -> dict:
    t0 = time.time()
    stage = Stage(manifest, index).cuda()
    build_s = time.time() - t0
    shape = manifest.model
    T = shape.seq_len
    tokens = torch.randint(0, shape.vocab_size, (batch, T), device="cuda")
    targets = torch.randint(0, shape.vocab_size, (batch, T), device="cuda")
    if stage.spec.is_head:
        inp = tokens
    else:
        # What arrives over the wire, decompressed: the residual stream of the previous stage (random but realistic
        # in scale), made to lie in span(F[token], U) in subspace mode, as the invariant guarantees.
        x = torch.randn(batch, T, shape.d_model, device="cuda") * 0.5
        if stage.subspace:
            b = compress(x, tokens, stage.basis, "bf16")
            inp = decompress(b, stage.basis, stage.frozen_embed)
        else:
            inp = x
        inp = inp.requires_grad_(True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = stage(inp)
            if stage.spec.is_tail:
                loss = stage.loss(out, targets)
            else:
                loss = (out.float() * out.float()).mean()  # stands in for the gradient the next stage sends back
        loss.backward()
        for p in stage.parameters():
            p.grad = None
        if not stage.spec.is_head:
            inp.grad = None

    seconds = timed(step)
    flops = stage_flops(manifest, index, batch * T)
    res = {
        "stage": index, "kind": "head" if stage.spec.is_head else "tail" if stage.spec.is_tail else "body",
        "mode": manifest.residual.mode, "layers": manifest.stages[index],
        "params_M": round(count_parameters(manifest)["per_stage"][index] / 1e6, 1),
        "tokens_per_microbatch": batch * T, "fwd_bwd_s": round(seconds, 5),
        "tokens_per_s": round(batch * T / seconds), "tflops": round(flops / seconds / 1e12, 1),
        "mfu_vs_datasheet": round(flops / seconds / 1e12 / PEAK_BF16_TFLOPS, 3), "build_s": round(build_s, 1),
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1),
    }
    res.update(uplink(stage.spec.is_head, stage.spec.is_tail, manifest, batch * T, seconds))
    if not stage.spec.is_tail:
        if stage.subspace:
            with torch.no_grad():
                out = stage(inp.detach() if not stage.spec.is_head else inp).float()
                rebuilt = decompress(compress(out, tokens, stage.basis, "fp32"), stage.basis, stage.frozen_embed)
                res["boundary_rel_err_fp32"] = float((out - rebuilt).abs().max() / out.abs().max())
    del stage
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return res


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    sub = load_manifest("agora-8b")
    dense = sub.with_overrides(**{"residual.mode": "dense", "residual.k": None})
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "matmul_tflops_bf16_8192": round(matmul_ceiling(), 1), "runs": []}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    batch = 1  # the preset's microbatch: one 4096-token sequence
    for manifest in (sub, dense):
        for index in sorted({min(2, sub.n_stages - 2), 0, sub.n_stages - 1}, key=lambda i: (i == 0, i)):  # body first
            try:
                r = bench_stage(manifest, index, batch)
            except torch.cuda.OutOfMemoryError as err:
                r = {"stage": index, "mode": manifest.residual.mode, "error": f"OOM: {err}"[:200]}
            report["runs"].append(r)
            print(json.dumps(r), flush=True)
            (out / "h200_stage_bench.json").write_text(json.dumps(report, indent=1))
    lines = [f"GPU stage benchmark on {report['device']} ({report['date']}, torch {report['torch']}); bf16 matmul "
             f"8192^3: {report['matmul_tflops_bf16_8192']} TFLOP/s", "",
             "| mode | stage | layers | params (M) | fwd+bwd (ms) | tokens/s | TFLOP/s | MFU | wire MB/mb | link @100Mb/s (s) | compute/link @100Mb/s | compute/link @1Gb/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['stage']} | error: {r['error'][:60]} |")
            continue
        wire = r.get("wire_bytes_per_microbatch")
        lines.append(
            f"| {r['mode']} | {r['kind']} ({r['stage']}) | {r['layers']} | {r['params_M']} | {r['fwd_bwd_s'] * 1e3:.1f} | "
            f"{r['tokens_per_s']} | {r['tflops']} | {r['mfu_vs_datasheet']:.2f} | "
            f"{wire / 1e6 if wire else 0:.2f} | {r.get('link_s_at_100mbps', '-')} | "
            f"{r.get('compute_over_link_at_100mbps', '-')} | {r.get('compute_over_link_at_1000mbps', '-')} |")
    (out / "h200_stage_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out/gpu")

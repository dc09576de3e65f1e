"""The memory planner (``agora.plan``, ``agora plan``): its formulas against autograd's saved tensors and measured
peaks (CPU here, the recorded H200 benchmark), its choices for the presets, its advice when nothing fits."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from agora.cli import app
from agora.config import load_manifest
from agora.model import Stage, count_parameters
from agora.plan import (GIB, Assumptions, Options, Search, all_options, block_bytes_per_token, choose,
                        plan_report, plan_stage, predict_stage_bytes, stage_shape, suggest_split)

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("plan_probe.py")


def _dense_tied():
    m = load_manifest("tiny")
    return m.with_overrides(**{"residual.mode": "dense", "residual.k": None, "model.tie_embeddings": True})


@pytest.mark.parametrize("preset", ["tiny", "small", "medium", "agora-8b", "dense-tied"])
def test_parameter_counts_are_the_models(preset):
    m = _dense_tied() if preset == "dense-tied" else load_manifest(preset)
    assert [stage_shape(m, i).parameters for i in range(m.n_stages)] == count_parameters(m)["per_stage"]
    one = m.with_overrides(stages=[m.model.n_layers])  # head and tail in one stage (a tied LM head multiplies too)
    assert stage_shape(one, 0).parameters == count_parameters(one)["per_stage"][0]


@pytest.mark.parametrize("index", [0, 1])
def test_matmul_parameters_are_the_linear_layers(index):
    m = load_manifest("tiny")
    stage = Stage(m, index)
    linear = sum(mod.weight.numel() for mod in stage.modules() if isinstance(mod, torch.nn.Linear))
    assert stage_shape(m, index).matmul_parameters == linear


def _saved_bytes(stage: Stage, x: torch.Tensor, autocast: bool) -> tuple[int, int]:
    """(activation bytes, bf16 weight-cast bytes) autograd saves for one forward: unique storages, the stage's own
    parameters and buffers excluded. A bf16 storage the size of a weight matrix (or of the basis U, cast for every
    subspace write) is a cast: no activation has those sizes at the token count used."""
    own = {t.untyped_storage().data_ptr() for t in [*stage.parameters(), *stage.buffers()]}
    cast_sizes = {2 * p.numel() for p in stage.parameters() if p.dim() == 2}
    if stage.basis is not None:
        cast_sizes.add(2 * stage.basis.numel())
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen[s.data_ptr()] = (s.nbytes(), t.dtype == torch.bfloat16 and s.nbytes() in cast_sizes)
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x)
    return sum(n for n, cast in seen.values() if not cast), sum(n for n, cast in seen.values() if cast)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("index", [1, 2])
def test_block_bytes_are_what_autograd_saves(precision, index, one_torch_thread):
    """The per-token count is exact, in fp32 and under CPU autocast (whose casting rules for these ops are CUDA's;
    the recorded H200 peaks below agree)."""
    m = load_manifest("small")
    stage = Stage(m, index)
    b, t = 3, m.model.seq_len  # 384 tokens: no activation is the size of a weight matrix
    x = torch.randn(b, t, m.model.d_model, requires_grad=True)
    acts, casts = _saved_bytes(stage, x, precision == "bf16")
    write = None if stage.spec.is_tail else m.residual.k
    assert acts == block_bytes_per_token(m.model, precision, write) * b * t * len(stage.layers)
    if precision == "bf16":
        basis_casts = 0 if write is None else 2 * len(stage.layers) * 2 * m.model.d_model * write  # d x k, negligible
        blocks = stage_shape(m, index).matmul_parameters - stage_shape(m, index).lm_head  # the loss is not run
        assert casts == 2 * blocks + basis_casts


def _probe(spec: str, index: int, b: int, f: int, options: Options, runtime: bool) -> subprocess.Popen:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, str(PROBE), spec, str(index), str(b), str(f), options.precision, options.backward,
            "1" if options.checkpointing else "0",
            *(["runtime", "1" if options.offload_optimizer else "0"] if runtime else [])]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# (manifest, stage, microbatch, in flight, options, through StageRuntime): head / body / tail, fp32 and bf16, stash
# and recompute, offloaded or not, per-block checkpointing, through the node's own runtime; a shape with a wide MLP
# (f = 8d, for the backward's workspace) through the probe's copy of its steps.
CASES = [
    ("small", 1, 8, 2, Options("fp32", "stash"), True),
    ("small", 1, 8, 2, Options("bf16", "recompute", offload_optimizer=True), True),
    ("small", 2, 8, 1, Options("bf16", "stash"), True),
    ("small", 0, 8, 2, Options("bf16", "stash", checkpointing=True), True),
    ("small", 2, 8, 1, Options("bf16", "stash", checkpointing=True), True),
    ("wide", 1, 8, 2, Options("fp32", "recompute"), False),
]


def _can_measure() -> bool:
    """The probe needs glibc (``MALLOC_MMAP_THRESHOLD_``) and a kernel whose peak resident set can be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _can_measure(), reason="needs Linux with glibc and a writable /proc/self/clear_refs")
def test_planned_peaks_match_measured_peaks_on_cpu(tmp_path):
    """Each case runs in a fresh process (``plan_probe.py`` explains the measurement); the planner's peak of a
    microbatch (weights, gradients, AdamW moments, snapshot, frozen tables, microbatches in flight, the working
    one; on a CPU the device and host parts are one memory) must be within 15% of the measured one, and so must
    what the microbatches in flight hold. Measured: 0.99 to 1.05 of the plan (docs/PLAN.md has the table)."""
    wide = tmp_path / "wide.yaml"
    wide_m = load_manifest("small").with_overrides(**{"model.d_model": 256, "model.n_heads": 4, "model.ffn_dim": 2048,
                                                      "model.vocab_size": 2048, "stages": [1, 2, 1],
                                                      "model.n_layers": 4})
    wide.write_text(wide_m.to_yaml())
    specs = {"small": "small", "wide": str(wide)}
    procs = [_probe(specs[name], i, b, f, o, runtime) for name, i, b, f, o, runtime in CASES]
    rows = []
    for (name, index, b, f, options, runtime), proc in zip(CASES, procs):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        measured = json.loads(out)
        m = load_manifest(specs[name])
        # One snapshot (the microbatches of a cycle share a version), no CUDA context, no averager.
        plan = plan_stage(m, index, options, b, f, Assumptions(versions=1, reserve_gib=0))
        predicted = sum(p.device + p.host for p in plan.parts
                        if p.phase in ("always", "microbatch") and p.name != "averaging buffers")
        rows.append((name, index, options.describe(), runtime, round(measured["peak"] / predicted, 3)))
        assert abs(measured["peak"] / predicted - 1) < 0.15, rows[-1]
        if plan.kind != "tail" and options.backward == "stash":
            assert abs(measured["held"] / (f * plan.held_per_microbatch) - 1) < 0.15, (rows[-1], measured)
    print(rows)


def test_planned_peaks_match_the_recorded_h200_benchmark():
    """``docs/bench/gpu/h200_stage_bench.json``: agora-8b stages, one 4096-token microbatch, bf16 autocast over
    fp32 weights, forward + backward with no optimizer (gradients freed after each step). The plan of that
    setting is the weights, the frozen tables and one microbatch's graph with its workspace (and logits)."""
    report = json.loads((ROOT / "docs/bench/gpu/h200_stage_bench.json").read_text())
    sub = load_manifest("agora-8b")
    dense = sub.with_overrides(**{"residual.mode": "dense", "residual.k": None})
    not_in_bench = {"gradients", "optimizer moments", "weight snapshots", "averaging buffers", "optimizer step",
                    "reserve", "microbatches in flight"}
    for run in report["runs"]:
        m = sub if run["mode"] == "subspace" else dense
        plan = plan_stage(m, run["stage"], Options("bf16", "recompute"), 1, 1, Assumptions(reserve_gib=0))
        predicted = sum(p.device for p in plan.parts if p.name not in not_in_bench) / GIB
        assert abs(predicted / run["peak_mem_GiB"] - 1) < 0.05, (run["mode"], run["kind"], predicted, run)


def test_options_are_ordered_cheapest_first():
    sets = all_options()
    assert sets[0] == Options("bf16", "stash", False, False)
    assert sets.index(Options("bf16", "stash", False, True)) < sets.index(Options("bf16", "recompute", False, False))
    assert sets.index(Options("bf16", "recompute", True, True)) > sets.index(Options("bf16", "recompute", False, True))
    assert all(o.precision == "fp32" for o in all_options("fp32")) and len(all_options("fp32")) == 8


def test_agora_8b_fits_24gb_with_offload_and_checkpointing():
    """Every agora-8b stage fits 24 GiB with the optimizer offloaded and per-block checkpointing (the tail in fp32:
    in bf16 the LM head's weight cast, 1 GiB, tips it over); without offload none does. Without checkpointing
    (``--no-checkpointing``) the head and bodies fit with ``recompute`` but the tail (6 dense blocks, its
    4096 x 128256 logits: 6 GiB) does not, and the planner proposes a split that moves three of its layers
    upstream."""
    m = load_manifest("agora-8b")
    choices = [choose(m, s, 24) for s in range(m.n_stages)]
    for c in choices:
        assert c.chosen is not None, c.advice
        precision = "fp32" if c.kind == "tail" else "bf16"
        assert c.chosen.options == Options(precision, "stash", offload_optimizer=True, checkpointing=True)
        assert all(p.device_bytes > 24 * GIB for p in c.candidates if not p.options.offload_optimizer)
    assert suggest_split(m, 24) == m.stages
    without = Search(checkpointing=False)
    report = plan_report(m, 24, search=without)
    assert [s["fits"] for s in report["stages"]] == [True] * 5 + [False]
    assert all(s["chosen"]["options"]["backward"] == "recompute" for s in report["stages"][:5])
    split = report["suggested_split"]
    assert split == [6, 6, 6, 6, 5, 3] and "searched" in report["verdict"]
    assert plan_report(m.with_overrides(stages=split), 24, search=without)["all_fit"]


def test_too_small_a_gpu_gets_advice_and_a_split():
    m = load_manifest("agora-8b")
    report = plan_report(m, 16)
    assert not report["all_fit"] and "does not fit 16 GiB" in report["verdict"]
    assert any("layers fit: move the others" in a for a in report["stages"][-1]["advice"])
    split = report["suggested_split"]
    assert split and sum(split) == m.model.n_layers and str(split) in report["verdict"]
    assert plan_report(m.with_overrides(stages=split), 16)["all_fit"]
    # An LM head with its logits larger than the GPU: no split helps, and the advice says what would.
    hopeless = plan_report(m, 12, stage=5)
    assert hopeless["suggested_split"] is None and "no split does" in hopeless["verdict"]
    assert any("even one block" in a and "shorter seq_len" in a for a in hopeless["stages"][0]["advice"])
    # A microbatch above 1: a smaller one is offered.
    medium = plan_report(load_manifest("medium"), 3)
    assert any("a microbatch of" in a for s in medium["stages"] for a in s["advice"])


def test_predict_stage_bytes_is_the_runtime_peak_without_reserve():
    """What ``agora bench gpu`` compares its measured peak with: the microbatch peak, no reserve; ``stepped=False``
    leaves out the moments AdamW has not allocated yet."""
    m = load_manifest("small")
    plan = plan_stage(m, 1, Options("bf16", "recompute"), 8, 1, Assumptions(reserve_gib=0))
    full = predict_stage_bytes(m, 1, "bf16", "recompute", microbatch=8, in_flight=1)
    assert full == plan.phase_bytes()["microbatch"]
    moments = 8 * count_parameters(m)["per_stage"][1]
    assert predict_stage_bytes(m, 1, "bf16", "recompute", microbatch=8, in_flight=1, stepped=False) == full - moments


def test_medium_preset():
    m = load_manifest("medium")
    assert 100e6 < count_parameters(m)["total"] < 350e6
    assert m.n_stages >= 4 and m.residual.mode == "subspace" and 512 <= m.model.seq_len <= 1024
    assert m.residual.k > load_manifest("small").residual.k and m.averaging.scheme == "full"
    report = plan_report(m, 24)
    assert report["all_fit"]
    assert all(s["chosen"]["options"] == {"precision": "bf16", "backward": "stash", "offload_optimizer": False,
                                          "checkpointing": False} for s in report["stages"])


def test_medium_vocabulary_trains_on_the_bundled_corpus():
    """The byte-level BPE reaches medium's 16384 tokens on the State of the Union corpus (cached after once)."""
    from agora.data import get_tokenizer

    m = load_manifest("medium")
    assert get_tokenizer(m.data, m.model.vocab_size).get_vocab_size() == m.model.vocab_size


def test_cli_plan():
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--manifest", "agora-8b", "--gpu-gb", "24"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "--offload-optimizer" in res.output and "every stage planned fits 24 GiB" in res.output
    res = runner.invoke(app, ["plan", "--manifest", "agora-8b", "--no-checkpointing"], env={"COLUMNS": "200"})
    assert res.exit_code == 1 and "[6, 6, 6, 6, 5, 3]" in res.output
    res = runner.invoke(app, ["plan", "--manifest", "medium", "--gpu-gb", "24", "--stage", "3", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["all_fit"] and [s["stage"] for s in data["stages"]] == [3]
    assert {p["name"] for p in data["stages"][0]["chosen"]["parts"]} >= {"weights", "logits", "averaging buffers"}
    res = runner.invoke(app, ["plan", "--manifest", "agora-8b", "--gpu-gb", "16"], env={"COLUMNS": "200"})
    assert res.exit_code == 1 and "a split that does" in res.output
    res = runner.invoke(app, ["plan", "--manifest", "tiny", "--stage", "7"])
    assert res.exit_code == 2

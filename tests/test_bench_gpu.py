"""``agora bench gpu`` keeps working without a GPU: the same measurement of a stage, on the CPU at tiny size."""

import json

import pytest
import torch

from agora.bench.gpu import run


def test_stage_bench_measures_every_stage_kind_in_both_backward_modes(tmp_path):
    result = run("tiny", tmp_path, device="cpu", precision="fp32", repeats=1)
    rows = result["rows"]
    assert {(r["stage"], r["backward"]) for r in rows} == {(0, "stash"), (0, "recompute"), (1, "stash"),
                                                           (1, "recompute")}
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 and r["tflops"] > 0 for r in rows)
    assert all(r["mfu"] is None for r in rows)  # no peak to compare with on a CPU: not made up
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["benchmark"] == "gpu" and saved["device"] == "cpu"
    assert "| stage |" in (tmp_path / "result.md").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_stage_bench_on_the_gpu_reports_mfu_and_device_memory(tmp_path):
    result = run("small", tmp_path, device="cuda", precision="bf16", repeats=2)
    assert all(r["peak_kind"] == "device allocated" and r["peak_bytes"] > 0 for r in result["rows"])

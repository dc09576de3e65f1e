"""``agora bench gpu`` keeps working without a GPU: the same measurement of a stage, on the CPU at tiny size."""

import json

import pytest
import torch

from agora.bench.gpu import run
from agora.config import load_manifest
from agora.plan import predict_stage_bytes


def test_stage_bench_measures_every_stage_kind_in_both_backward_modes_and_checkpointed(tmp_path):
    result = run("tiny", tmp_path, device="cpu", precision="fp32", repeats=1)
    rows = result["rows"]
    assert sorted((r["stage"], r["backward"], r["checkpoint_blocks"]) for r in rows) == [
        (s, b, c) for s in (0, 1) for b, c in (("recompute", False), ("stash", False), ("stash", True))]
    for r in rows:  # the planner's prediction is of the row's own options
        assert r["predicted_bytes"] == predict_stage_bytes(
            load_manifest("tiny"), r["stage"], precision="fp32", backward=r["backward"], microbatch=1, in_flight=1,
            checkpointing=r["checkpoint_blocks"], stepped=False)
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 and r["tflops"] > 0 for r in rows)
    assert all(r["mfu"] is None for r in rows)  # no peak to compare with on a CPU: not made up
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["benchmark"] == "gpu" and saved["device"] == "cpu"
    assert "| stage |" in (tmp_path / "result.md").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_stage_bench_on_the_gpu_reports_mfu_and_device_memory(tmp_path):
    result = run("small", tmp_path, device="cuda", precision="bf16", repeats=2)
    assert all(r["peak_kind"] == "device allocated" and r["peak_bytes"] > 0 for r in result["rows"])

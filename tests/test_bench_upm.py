"""``agora bench upm`` end to end on ``tiny`` (``--preset``; few transforms): the function survives, stitched shards
do not."""

import json
import subprocess
import sys


def test_bench_upm_measures_preservation_and_stitching(tmp_path):
    out = tmp_path / "upm"
    proc = subprocess.run([sys.executable, "-m", "agora.cli", "bench", "upm", "--out", str(out), "--preset", "tiny",
                           "--transforms", "12", "--train-steps", "1", "--training-steps", "4", "--rotate-every", "2",
                           "--training-seeds", "0"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "result.json").read_text())
    small = result["small"]
    assert [r["transforms"] for r in small["fp64"]] == [0, 1, 10, 12]
    assert max(r["max_abs_dlogit"] for r in small["fp64"]) < 1e-9
    assert max(r["max_abs_dlogit"] for r in small["fp32"]) < 1e-3
    assert max(r["js_mean"] for r in small["fp32"]) < 4e-5
    stitched = small["stitching"]
    assert small["preset"] == "tiny" and result["training"]["preset"] == "tiny"
    assert {(s["gap"], s["stage"]) for s in stitched} == {(g, s) for g in (1, 100) for s in range(2)}
    # A shard one rotation older does not fit: it moves the output by orders of magnitude more than rounding.
    assert min(s["js_stitched"] for s in stitched) > 1e3 * max(r["js_mean"] for r in small["fp32"])
    assert "Stitching" in (out / "result.md").read_text()
    training = {r["mode"]: r for r in result["training"]["rows"]}
    assert set(training) == {"none", "mixed", "isotropic", "keep", "signed_perm"}
    assert training["none"]["rotations"] == 0 and training["mixed"]["rotations"] == 2
    assert len({r["tokens"] for r in training.values()}) == 1  # equal tokens
    assert training["none"]["loss_ratio"] == 1.0
    assert all(0.5 < r["loss_ratio"] < 1.5 for r in training.values())


def test_bench_upm_with_signed_permutations_on_a_coordinate_basis(tmp_path):
    """``--frames signed_permutations``: `tiny` on a coordinate basis, transforms that only rename coordinates
    (the function is kept to rounding, and a renamed-away shard still does not fit), and the coordinate rows of the
    training section: the signed permutations' ratio is to the coordinate basis without them."""
    out = tmp_path / "upm"
    proc = subprocess.run([sys.executable, "-m", "agora.cli", "bench", "upm", "--out", str(out), "--preset", "tiny",
                           "--transforms", "12", "--train-steps", "1", "--training-steps", "4", "--rotate-every", "2",
                           "--training-seeds", "0", "--frames", "signed_permutations",
                           "--training-modes", "none,none_coordinates,signed_perm_coordinates"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "result.json").read_text())
    small = result["small"]
    assert small["basis"] == "coordinates"
    assert max(r["max_abs_dlogit"] for r in small["fp64"]) < 1e-9
    assert max(r["max_abs_dlogit"] for r in small["fp32"]) < 1e-3
    assert min(s["js_stitched"] for s in small["stitching"]) > 1e3 * max(r["js_mean"] for r in small["fp32"])
    assert "signed permutations" in (out / "result.md").read_text()
    training = {r["mode"]: r for r in result["training"]["rows"]}
    assert training["signed_perm_coordinates"]["rotations"] == 2
    # Exact up to summation order: far closer to its own baseline than any Haar treatment gets (0.3-1.4%).
    assert abs(training["signed_perm_coordinates"]["loss_ratio"] - 1.0) < 1e-4
    assert training["none_coordinates"]["loss_ratio"] != 1.0  # another model than the random basis
    bad = subprocess.run([sys.executable, "-m", "agora.cli", "bench", "upm", "--out", str(tmp_path / "bad"),
                          "--frames", "householder"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "frames must be one of" in bad.stdout + bad.stderr
    bad = subprocess.run([sys.executable, "-m", "agora.cli", "bench", "upm", "--out", str(tmp_path / "bad"),
                          "--preset", "no-such-preset"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not found" in bad.stdout + bad.stderr

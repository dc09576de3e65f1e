#!/usr/bin/env bash
# Every GPU measurement of docs/GPU.md in one run, for a lent GPU machine (about 10 minutes on one H100/H200-class
# card; no downloads). Writes OUT/machine.txt (date, card, driver, torch), OUT/pytest-cuda.txt (the CUDA tests),
# OUT/stages/ (`agora bench gpu`: per-stage time, MFU, peak memory against the planner at agora-8b shapes) and
# OUT/efficiency/ (`agora bench efficiency`: a swarm sharing the card against train-local at equal tokens).
#
#   bash docs/bench/gpu/run_gpu_checks.sh OUT
#
# Each part has its own time limit and the next one runs whatever happened. The variables below shrink it for a
# dry run on a CPU (DEVICE=cpu PRECISION=fp32 STAGE_MANIFEST=small SWARM_PRESET=tiny SWARM_STAGES=2 STEPS=3).
set -u
OUT=${1:?usage: run_gpu_checks.sh OUT}
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
PRECISION=${PRECISION:-bf16}
STAGE_MANIFEST=${STAGE_MANIFEST:-agora-8b}
SWARM_PRESET=${SWARM_PRESET:-medium}
SWARM_STAGES=${SWARM_STAGES:-4}
STEPS=${STEPS:-30}
mkdir -p "$OUT"
status=0

{
  date -u
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available',
torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
} > "$OUT/machine.txt" 2>&1

echo "== CUDA tests"
timeout 300 "$PY" -m pytest -q -rs -k "cuda or gpu" tests/test_runtime_compute.py tests/test_bench_gpu.py \
  > "$OUT/pytest-cuda.txt" 2>&1 || status=1
tail -3 "$OUT/pytest-cuda.txt"

echo "== per-stage time, MFU and peak memory against the plan ($STAGE_MANIFEST)"
timeout 300 "$PY" -m agora.cli bench gpu --manifest "$STAGE_MANIFEST" --device "$DEVICE" --precision "$PRECISION" \
  --out "$OUT/stages" > "$OUT/stages.log" 2>&1 || status=1
tail -3 "$OUT/stages.log"

echo "== swarm on one device vs train-local at equal tokens ($SWARM_PRESET, $SWARM_STAGES stages)"
timeout 420 "$PY" -m agora.cli bench efficiency --preset "$SWARM_PRESET" --stages "$SWARM_STAGES" --replicas 1 \
  --steps "$STEPS" --repeats 1 --device "$DEVICE" --precision "$PRECISION" --out "$OUT/efficiency" \
  > "$OUT/efficiency.log" 2>&1 || status=1
tail -3 "$OUT/efficiency.log"
exit $status

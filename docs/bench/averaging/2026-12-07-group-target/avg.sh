#!/bin/bash
# #18's averaging bench at 4 Mbit/s, code before (bdac06d) and after (edf217f) side by side, seed by seed.
cd /work/main
for S in 0 1 2; do
  for arm in base dev; do
    echo "$(date -u +%H:%M:%S) start $arm seed $S"
    PYTHONPATH=/work/$arm/src timeout 1500 .venv/bin/agora bench averaging --preset tiny --stages 2 --replicas 2 \
      --steps 8 --every 2 --seeds $S --schemes full,diloco+float16,gossip_q1,gossip_q1+float16 --conditions capped \
      --out /work/benchruns/s41/avg-$arm-s$S > /work/benchruns/s41/avg-$arm-s$S.log 2>&1
    echo "$(date -u +%H:%M:%S) end $arm seed $S rc=$?"
  done
done

#!/bin/bash
# #18 at 4 Mbit/s after gossip's reference-difference exchanges, seed by seed.
cd /work/main
for S in 0 1 2; do
  echo "$(date -u +%H:%M:%S) start seed $S"
  timeout 1500 .venv/bin/agora bench averaging --preset tiny --stages 2 --replicas 2 \
    --steps 8 --every 2 --seeds $S --schemes full,diloco+uint8,gossip_q1+float16,gossip_q1+uint8 --conditions capped \
    --out /work/benchruns/s45/avg-s$S > /work/benchruns/s45/avg-s$S.log 2>&1
  echo "$(date -u +%H:%M:%S) end seed $S rc=$?"
done

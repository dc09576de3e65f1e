#!/bin/bash
# #18 with a replica killed every 30 s: gossip q = 1, exact and uint8 from the pair's reference (joiners: references cleared).
cd /work/main
echo "$(date -u +%H:%M:%S) start kill"
timeout 1200 .venv/bin/agora bench averaging --preset tiny --stages 2 --replicas 2 --steps 40 --every 2 \
  --schemes gossip_q1,gossip_q1+uint8 --conditions kill --kill-every 30 --out /work/benchruns/s45/kill > /work/benchruns/s45/kill.log 2>&1
echo "$(date -u +%H:%M:%S) end kill rc=$?"
timeout 900 .venv/bin/agora bench averaging --preset tiny --stages 2 --replicas 2 --steps 40 --every 2 \
  --schemes gossip_q1,gossip_q1+uint8 --conditions clean --out /work/benchruns/s45/clean > /work/benchruns/s45/clean.log 2>&1
echo "$(date -u +%H:%M:%S) end clean rc=$?"

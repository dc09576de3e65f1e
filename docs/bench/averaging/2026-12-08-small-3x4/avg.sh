#!/bin/bash
# #18 at the shape: small, 3 stages x 4 replicas, 4 Mbit/s per peer, one seed
cd /tmp/benchtree2
PYTHONPATH=src /work/main/.venv/bin/python -m agora.cli bench averaging --preset small --stages 3 --replicas 4 \
    --steps 12 --every 4 --seeds 0 --schemes gossip_q1+uint8,diloco+uint8,full --conditions capped \
    --arm-timeout 1500 --out /tmp/avg3x4/out
echo "rc=$?"

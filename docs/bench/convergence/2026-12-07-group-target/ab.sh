#!/bin/bash
# A/B: base (bdac06d, every round waits min_matchmaking_time) vs new (9d8b086, target group size), alternating.
cd /work/main
for rep in 1 2; do
  for arm in base dev; do
    echo "$(date -u +%H:%M:%S) start $arm rep $rep"
    PYTHONPATH=/work/$arm/src timeout 1800 .venv/bin/agora bench convergence --preset small --steps 20 --seeds 0 \
      --rows replicas,all_powersgd --out /work/benchruns/s41/ab-$arm-$rep > /work/benchruns/s41/ab-$arm-$rep.log 2>&1
    echo "$(date -u +%H:%M:%S) end $arm rep $rep rc=$?"
  done
done

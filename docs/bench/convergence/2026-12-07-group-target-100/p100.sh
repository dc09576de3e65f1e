#!/bin/bash
cd /work/main
for S in 1 2 0; do
  echo "$(date -u +%H:%M:%S) start seed $S"
  timeout 2400 .venv/bin/agora bench convergence --preset small --steps 100 --seeds $S --rows all_powersgd \
    --powersgd-dense-every 10 --out /work/benchruns/s41/psgd100-s$S > /work/benchruns/s41/psgd100-s$S.log 2>&1
  echo "$(date -u +%H:%M:%S) end seed $S rc=$?"
done

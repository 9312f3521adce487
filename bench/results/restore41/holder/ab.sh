#!/bin/bash
cd /tmp/exp41/bench
for k in 1 2 3 4; do
  b=$(( k % 2 == 0 ? 1 : 0 ))
  PYTHONPATH=/work/main HOLDER_BLOCKING=$b timeout 600 /work/main/.venv/bin/python bench_sharded_restore.py --out /tmp/exp41/ab_${k}_blocking$b.json > /tmp/exp41/ab_$k.log 2>&1
  echo "$k blocking=$b rc=$? $(date +%T)"
done

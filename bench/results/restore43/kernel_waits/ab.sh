#!/bin/bash
# A/B: kernel-bounded waits within a deadline (B: /work/wt/dev) against 398a732 (A: /work/wt/a).
set -u
O=/tmp/ab43/k; P=/work/main/.venv/bin/python; mkdir -p $O
cd /tmp/ab43/bench
for k in $(seq ${2:-1} $(( ${2:-1} + ${1:-3} - 1 ))); do
  for v in A B; do
    if [ $v = B ]; then export PYTHONPATH=/work/wt/dev; else export PYTHONPATH=/work/wt/a; fi
    timeout 600 $P bench_peer_restore.py --out $O/${v}_$k.json > $O/${v}_$k.log 2>&1
    echo "$v $k rc=$? $(date -u +%T) $(grep -o 'runs at [0-9.]*x[^)]*' $O/${v}_$k.log) $(grep SPLIT $O/${v}_$k.log | cut -c60-)"
  done
done

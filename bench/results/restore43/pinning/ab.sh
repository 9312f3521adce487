#!/bin/bash
# The same tree, alternating unpinned (A) and pinned (B: holder on CPU 0, fetcher on CPU 1) runs.
set -u
O=/tmp/ab43/pin; P=/work/main/.venv/bin/python; mkdir -p $O
cd /tmp/ab43/bench; export PYTHONPATH=/work/wt/a
for k in $(seq 1 ${1:-4}); do
  for v in A B; do
    if [ $v = B ]; then export PIN=1; else unset PIN; fi
    timeout 600 $P bench_peer_restore.py --out $O/${v}_$k.json > $O/${v}_$k.log 2>&1
    echo "$v $k rc=$? $(date -u +%T) $(grep -o 'runs at [0-9.]*x[^)]*' $O/${v}_$k.log) $(grep SPLIT $O/${v}_$k.log | cut -c60-)"
  done
done

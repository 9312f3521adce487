#!/bin/bash
# A/B: one piece per single-holder fetch (SPIKE_ONE_PIECE=1) against as-is, alternating.
set -u
T=/work/wt/b; O=/tmp/ab43; P=/work/main/.venv/bin/python
cd $T; export PYTHONPATH=$T
for k in $(seq 1 ${1:-3}); do
  for v in A B; do
    if [ $v = B ]; then export SPIKE_ONE_PIECE=1; else unset SPIKE_ONE_PIECE; fi
    timeout 600 $P bench/bench_peer_restore.py --out $O/${v}_$k.json > $O/${v}_$k.log 2>&1
    echo "$v $k rc=$? $(date -u +%T) $(grep -o 'runs at [0-9.]*x' $O/${v}_$k.log)"
  done
done

#!/bin/bash
# A/B: RunCheck streamed per piece as it lands (SPIKE_STREAM=1) against one call per block after it landed.
set -u
O=/tmp/ab43/s; P=/work/main/.venv/bin/python; mkdir -p $O
cd /tmp/ab43/bench; export PYTHONPATH=/work/wt/b
for k in $(seq ${2:-1} $(( ${2:-1} + ${1:-3} - 1 ))); do
  for v in A B; do
    if [ $v = B ]; then export SPIKE_STREAM=1; else unset SPIKE_STREAM; fi
    timeout 600 $P bench_peer_restore.py --out $O/${v}_$k.json > $O/${v}_$k.log 2>&1
    echo "$v $k rc=$? $(date -u +%T) $(grep -o 'runs at [0-9.]*x[^)]*' $O/${v}_$k.log) $(grep SPLIT $O/${v}_$k.log | cut -c60-)"
  done
done

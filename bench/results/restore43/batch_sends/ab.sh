#!/bin/bash
# A/B: a holder sends up to 64 MiB of frames (500 parts) per sendmsg (SPIKE_BATCH) against one frame per call.
set -u
O=/tmp/ab43/batch; P=/work/main/.venv/bin/python; mkdir -p $O
cd /tmp/ab43/bench; export PYTHONPATH=/work/wt/b
for k in $(seq ${2:-1} $(( ${2:-1} + ${1:-3} - 1 ))); do
  for v in A B; do
    if [ $v = B ]; then export SPIKE_BATCH=67108864; else unset SPIKE_BATCH; fi
    timeout 600 $P bench_peer_restore.py --out $O/${v}_$k.json > $O/${v}_$k.log 2>&1
    echo "$v $k rc=$? $(date -u +%T) $(grep -o 'runs at [0-9.]*x[^)]*' $O/${v}_$k.log) $(grep SPLIT $O/${v}_$k.log | cut -c60-)"
  done
done

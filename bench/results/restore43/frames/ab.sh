#!/bin/bash
# A/B: 4 blocks a frame (max frame 16 MiB + 64 KiB, chunk 16 MiB) against as-is, alternating.
set -u
O=/tmp/ab43/f; P=/work/main/.venv/bin/python; mkdir -p $O
cd /tmp/ab43/bench; export PYTHONPATH=/work/wt/b
for k in $(seq 1 ${1:-3}); do
  for v in A B; do
    if [ $v = B ]; then export SPIKE_MAX_FRAME=16842752 SPIKE_CHUNK=16777216; else unset SPIKE_MAX_FRAME SPIKE_CHUNK; fi
    timeout 600 $P bench_peer_restore.py --out $O/${v}_$k.json > $O/${v}_$k.log 2>&1
    echo "$v $k rc=$? $(date -u +%T) $(grep -o 'runs at [0-9.]*x[^)]*' $O/${v}_$k.log) $(grep SPLIT $O/${v}_$k.log | cut -c60-)"
  done
done

#!/bin/bash
# restore38's peer-restore A/B: bench_peer_restore.py at its defaults, the new tree (/tmp/r38/new,
# a copy of this change) and main e0f6343 (/tmp/r38/old, as ab/hold.sh leaves it) interleaved,
# ROUNDS pairs; both run the new tree's bench. Run as:
#   /work/wt/cpulock bash bench/results/restore38/peer/hold.sh [ROUNDS]
set -u
R=/work/main; ROUNDS=${1:-3}; O=$R/bench/results/restore38/peer; P=$R/.venv/bin/python
cp /tmp/r38/new/bench/bench_peer_restore.py /tmp/r38/new/bench/verified_floor.py /tmp/r38/new/bench/proc_cpu.py /tmp/r38/old/bench/
echo "hold start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
k=0
for i in $(seq 1 $ROUNDS); do
  order="new old"; [ $((i % 2)) = 0 ] && order="old new"
  for tree in $order; do
    k=$((k + 1)); T=/tmp/r38/$tree
    cd $T && PYTHONPATH=$T timeout 300 $P bench/bench_peer_restore.py --out $O/peer_${tree}_$k.json \
      2>&1 | grep -E "runs at" | sed "s/^/$k $tree: /"
  done
done
echo "hold end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd)"

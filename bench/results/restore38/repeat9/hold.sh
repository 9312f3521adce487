#!/bin/bash
# restore38's long-run hold: bench_sharded_restore.py --repeat 9 (nine paired timed rounds a
# run) on this tree, /dev/shm and --huge-tmpfs alternated, RUNS runs (default 4). Run as:
#   /work/wt/cpulock bash bench/results/restore38/repeat9/hold.sh [RUNS]
set -u
R=/work/main; RUNS=${1:-4}; O=$R/bench/results/restore38/repeat9; P=$R/.venv/bin/python
cd $R
echo "hold start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) tree: $(git rev-parse --short HEAD)"
for k in $(seq 1 $RUNS); do
  pages=shm; flag=""; [ $((k % 2)) = 0 ] && { pages=huge; flag=--huge-tmpfs; }
  timeout 400 $P bench/bench_sharded_restore.py --repeat 9 $flag \
    --out $O/sharded_${pages}_new_$k.json > /tmp/r38/logs/repeat9_$k.log 2>&1
  echo "$k $pages rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  tail -3 /tmp/r38/logs/repeat9_$k.log > $O/sharded_${pages}_new_$k.tail
done
echo "hold end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

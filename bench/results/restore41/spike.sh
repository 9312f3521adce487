#!/bin/bash
# restore41's spike runs: bench_sharded_restore.py --spike-worker-fetch at its defaults, RUNS
# runs alternating /dev/shm and huge pages, from a tree (default /work/main). Run as:
#   /work/wt/cpulock bash bench/results/restore41/spike.sh [RUNS] [FIRST]
set -u
T=${SPIKE_TREE:-/work/main}; RUNS=${1:-4}; FIRST=${2:-1}
O=/work/main/bench/results/restore41/spike; P=/work/main/.venv/bin/python
L=/tmp/r41/spike-logs; mkdir -p $O $L; cd $T; export PYTHONPATH=$T
echo "spike start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) tree: $(git rev-parse --short HEAD) ($T)"
for k in $(seq $FIRST $((FIRST + RUNS - 1))); do
  pages=shm; flag=""; [ $((k % 2)) = 0 ] && { pages=huge; flag=--huge-tmpfs; }
  timeout 600 $P bench/bench_sharded_restore.py --spike-worker-fetch $flag \
    --out $O/sharded_${pages}_spike_$k.json > $L/spike_$k.log 2>&1
  echo "$k $pages rc=$? $(date -u +%T)"
done
echo "spike end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd) mounts: $(grep -c elasticd-bench /proc/mounts)"

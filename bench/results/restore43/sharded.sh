#!/bin/bash
# restore43 runs: bench_sharded_restore.py at its defaults with the spike beside it
# (--spike-worker-fetch), elasticd's own path now the worker's direct fetch; RUNS runs
# alternating /dev/shm and huge pages, from a worktree (DIRECT_TREE). Run as:
#   DIRECT_TREE=/work/wt/r42 /work/wt/cpulock bash bench/results/restore43/sharded.sh [RUNS] [FIRST]
set -u
T=${DIRECT_TREE:-/work/main}; RUNS=${1:-4}; FIRST=${2:-1}
O=/work/main/bench/results/restore43/sharded; P=/work/main/.venv/bin/python
L=/tmp/r43/logs; mkdir -p $O $L; cd $T; export PYTHONPATH=$T
echo "start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) tree: $(git rev-parse --short HEAD) ($T)"
for k in $(seq $FIRST $((FIRST + RUNS - 1))); do
  pages=shm; flag=""; [ $((k % 2)) = 0 ] && { pages=huge; flag=--huge-tmpfs; }
  timeout 600 $P bench/bench_sharded_restore.py --spike-worker-fetch $flag \
    --out $O/sharded_${pages}_$k.json > $L/run_$k.log 2>&1
  echo "$k $pages rc=$? $(date -u +%T)"
done
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd) mounts: $(grep -c elasticd-bench /proc/mounts)"

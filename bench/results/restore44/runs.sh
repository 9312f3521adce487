#!/bin/bash
# restore44: every figure issue 30 asks for, on the receive mark's tree (HEAD_TREE) against
# main before it (BASE_TREE, 4120f9b) where the issue asks for "no slower". In order:
#   peer:    bench_peer_restore.py, defaults, PEER runs (head only: the floor is in the run);
#   sharded: bench_sharded_restore.py, defaults, one run on /dev/shm, one on huge pages;
#   kill9:   bench_recovery.py --runs 3 --baseline-runs 0, blocks head, base, head, base.
# Run as:
#   HEAD_TREE=/work/wt/head BASE_TREE=/work/wt/base /work/wt/cpulock bash bench/results/restore44/runs.sh
set -u
P=/work/main/.venv/bin/python; O=/work/main/bench/results/restore44; L=/tmp/r44/logs
PEER=${PEER:-2}; mkdir -p $O/peer $O/sharded $O/kill9 $L
echo "start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) head $(git -C $HEAD_TREE rev-parse --short HEAD) base $(git -C $BASE_TREE rev-parse --short HEAD)"
cd $HEAD_TREE; export PYTHONPATH=$HEAD_TREE
for k in $(seq 2 $((PEER + 1))); do
  timeout 300 $P bench/bench_peer_restore.py --out $O/peer/peer_$k.json > $O/peer/peer_$k.txt 2>&1
  echo "peer $k rc=$? $(date -u +%T)"
done
n=0
for pages in shm huge; do
  flag=""; [ $pages = huge ] && flag=--huge-tmpfs
  timeout 600 $P bench/bench_sharded_restore.py --spike-worker-fetch $flag \
    --out $O/sharded/sharded_${pages}_$((n += 1)).json > $L/sharded_$pages.log 2>&1
  echo "sharded $pages rc=$? $(date -u +%T)"
done
k=0
for tree in head base head base; do
  k=$((k + 1))
  if [ $tree = head ]; then T=$HEAD_TREE; else T=$BASE_TREE; fi
  cd $T; export PYTHONPATH=$T
  timeout 300 $P bench/bench_recovery.py --runs 3 --baseline-runs 0 \
    --out $O/kill9/recovery_block${k}_$tree.json > $O/kill9/recovery_block${k}_$tree.log 2>&1
  echo "kill9 block $k $tree rc=$? $(date -u +%T)"
done
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd) mounts: $(grep -c elasticd-bench /proc/mounts)"

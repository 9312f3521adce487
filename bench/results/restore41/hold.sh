#!/bin/bash
# restore41's hold of a tree (default: main as it was at fa55375, the session's start, from a
# worktree, so that edits in /work/main during the hold change nothing it runs): both issue-30
# benches at their defaults, RUNS sharded runs (/dev/shm and --huge-tmpfs alternated) then PEER
# peer-restore runs. Run as:
#   git worktree add /tmp/hold41 fa55375
#   HOLD_TREE=/tmp/hold41 /work/wt/cpulock bash bench/results/restore41/hold.sh [RUNS] [PEER] [NAME]
set -u
T=${HOLD_TREE:-/work/main}; RUNS=${1:-4}; PEER=${2:-3}; NAME=${3:-main}
O=${HOLD_OUT:-/work/main/bench/results/restore41/hold}; P=/work/main/.venv/bin/python
L=${HOLD_LOGS:-/tmp/r41/logs}; mkdir -p $O $L; cd $T
export PYTHONPATH=$T
echo "hold start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) tree: $(git rev-parse --short HEAD) ($T)"
for k in $(seq 1 $RUNS); do
  pages=shm; flag=""; [ $((k % 2)) = 0 ] && { pages=huge; flag=--huge-tmpfs; }
  timeout 400 $P bench/bench_sharded_restore.py $flag --out $O/sharded_${pages}_${NAME}_$k.json \
    > $L/sharded_$k.log 2>&1
  echo "$k $pages rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  tail -3 $L/sharded_$k.log > $O/sharded_${pages}_${NAME}_$k.tail
done
for k in $(seq 1 $PEER); do
  timeout 300 $P bench/bench_peer_restore.py --out $O/peer_$k.json 2>&1 | grep -E "runs at" | sed "s/^/peer $k: /"
done
echo "hold end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd) mounts: $(grep -c elasticd-bench /proc/mounts)"

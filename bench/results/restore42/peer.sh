#!/bin/bash
# restore42's peer runs: bench_peer_restore.py at its defaults (RUNS runs from FIRST) and one
# at --repeat 25, from a worktree (PEER_TREE). Run as:
#   PEER_TREE=/work/wt/r42 /work/wt/cpulock bash bench/results/restore42/peer.sh [RUNS] [FIRST]
set -u
T=${PEER_TREE:-/work/main}; RUNS=${1:-2}; FIRST=${2:-2}
O=/work/main/bench/results/restore42/peer; P=/work/main/.venv/bin/python
mkdir -p $O; cd $T; export PYTHONPATH=$T
echo "start $(date -u +%T) tree: $(git rev-parse --short HEAD) ($T)"
for k in $(seq $FIRST $((FIRST + RUNS - 1))); do
  timeout 600 $P bench/bench_peer_restore.py --out $O/peer_$k.json > /tmp/r42-peer$k.log 2>&1
  echo "$k rc=$? $(date -u +%T)"
done
[ "${SKIP25:-0}" = 1 ] || timeout 900 $P bench/bench_peer_restore.py --repeat 25 --out $O/peer25_1.json > /tmp/r42-peer25.log 2>&1
echo "25 rounds rc=$? $(date -u +%T)"
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd)"

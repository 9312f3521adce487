#!/bin/bash
# restore42: the kill -9 recovery bench (restart path, defaults but --runs 3 a block), blocks
# head, base, head, base: head = HEAD_TREE (the direct fetch), base = BASE_TREE (d46afc3, main
# at the session's start), each a worktree run with its own bench and PYTHONPATH. Run as:
#   HEAD_TREE=/work/wt/r42 BASE_TREE=/work/wt/r42base /work/wt/cpulock bash bench/results/restore42/kill9.sh
P=/work/main/.venv/bin/python; O=/work/main/bench/results/restore42/kill9; L=/tmp/r42/kill9
mkdir -p $O $L
echo "start $(date -u +%T)"
k=0
for tree in head base head base; do
  k=$((k + 1))
  if [ $tree = head ]; then T=$HEAD_TREE; else T=$BASE_TREE; fi
  cd $T
  PYTHONPATH=$T timeout 300 $P bench/bench_recovery.py --runs 3 --baseline-runs 0 \
    --out $O/recovery_block${k}_$tree.json > $L/recovery_block${k}_$tree.log 2>&1
  echo "block $k $tree rc=$? $(date -u +%T) tree $(git -C $T rev-parse --short HEAD)"
done
echo "leftover shm: $(ls /dev/shm | grep -c elasticd) end $(date -u +%T)"

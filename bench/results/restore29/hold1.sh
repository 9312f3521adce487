#!/bin/bash
# Hold 1: the kill -9 recovery bench (restart path, elasticd only, defaults but --runs 3 a
# block), this branch's bench (clock from the first SIGKILL, the probe's revocation read from
# the daemons' logs) against two trees: head = this worktree; base = 3f48c4f (main before issue
# 30's first merge, 47047d5^1) as a git archive copy with this branch's bench_recovery.py
# copied into it (its own elasticd, examples/train.py and launcher: PYTHONPATH and cwd). Blocks
# head, base, head, base, head; head's work directories kept (logs: the timeline of each run).
P=/work/wt/restore29/.venv/bin/python; O=/work/wt/restore29/bench/results/restore29; L=/tmp/r29/h1
START=$(date -u +%s); END=$((START + 700))
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
echo "start $(date -u +%T)"
k=0
for tree in head base head base head; do
  k=$((k + 1))
  if [ $tree = head ]; then T=/work/wt/restore29; KEEP="--keep /tmp/r29/keep/block$k"; else T=/tmp/r29/tree-3f48c4f; KEEP=""; fi
  cd $T
  if fits 100; then
    PYTHONPATH=$T timeout 200 $P bench/bench_recovery.py --runs 3 --baseline-runs 0 $KEEP \
      --out $O/recovery_block${k}_$tree.json > $L/recovery_block${k}_$tree.log 2>&1
    echo "block $k $tree rc=$? $(date -u +%T) elasticd from $(PYTHONPATH=$T $P -c 'import elasticd; print(elasticd.__file__)')"
  else echo "block $k $tree skipped $(date -u +%T)"; fi
done
echo "leftover shm: $(ls /dev/shm | grep -c elasticd) end $(date -u +%T)"

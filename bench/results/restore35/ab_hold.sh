#!/bin/bash
# restore35's A/B hold: bench_sharded_restore.py at its defaults (/dev/shm), the old tree
# (/tmp/r35/old: a git worktree of main fd88171) and the new one (/work/wt/restore35, this
# branch, committed), each run from inside its tree with PYTHONPATH set to it (each result's
# "code" names the elasticd it imported; every spawned process checks it), interleaved
# new old old new new old old new, as many as fit in SECONDS (first argument).
O=/work/wt/restore35/bench/results/restore35; L=/tmp/r35/ab
P=/work/wt/restore35/.venv/bin/python
START=$(date -u +%s); END=$((START + $1))
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
echo "ab start $(date -u +%T) end by $(date -u -d @$END +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
run() {  # run <tree: new|old> <k>
  local T=/work/wt/restore35 out=$O/sharded_shm_$1_$2.json
  [ "$1" = old ] && T=/tmp/r35/old
  fits 110 || { echo "$2 $1 left out $(date -u +%T)"; return; }
  cd $T && PYTHONPATH=$T timeout 150 $P bench/bench_sharded_restore.py --out $out \
    > $L/sharded_shm_$1_$2.log 2>&1
  echo "$2 $1 rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
}
cd /work/wt/restore35 && timeout 120 $P -m pytest -q -p no:cacheprovider tests/unit/test_slot_rows.py tests/unit/test_huge_pages.py tests/unit/test_restore_scratch.py tests/unit/test_worker_shards.py tests/unit/test_store_peer_restore.py tests/unit/test_restore_own_shard.py tests/unit/test_class_sizes.py tests/unit/test_import_contracts.py > $L/tests_new.txt 2>&1
echo "tests new rc=$? $(date -u +%T)"
cd /tmp/r35/oldcheck && PYTHONPATH=/tmp/r35/oldcheck timeout 60 $P -m pytest -q -p no:cacheprovider tests/unit/test_slot_rows.py > $L/tests_old.txt 2>&1
echo "tests old rc=$? $(date -u +%T)"
run new 1; run old 2; run old 3; run new 4; run new 5; run old 6; run old 7; run new 8
echo "ab end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

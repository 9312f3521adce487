#!/bin/bash
# restore36's one hold: the touched tests, bench_peer_restore.py at its defaults once, then
# bench_sharded_restore.py at its defaults A/B, the old tree (/tmp/r36/old: `git archive
# 07203cd`, main) against the new (/work/wt/restore36, this branch, committed), each run from
# inside its tree with PYTHONPATH set to it (each result's "code" names the elasticd it
# imported), interleaved new old old new on /dev/shm and on --huge-tmpfs in turn, as many as
# fit in SECONDS (first argument).
O=/work/wt/restore36/bench/results/restore36; L=/tmp/r36/ab
P=/work/wt/restore36/.venv/bin/python
START=$(date -u +%s); END=$((START + $1))
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
echo "hold start $(date -u +%T) end by $(date -u -d @$END +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
run() {  # run <tree: new|old> <pages: shm|huge> <k>
  local T=/work/wt/restore36 out=$O/sharded_$2_$1_$3.json flag=""
  [ "$1" = old ] && T=/tmp/r36/old
  [ "$2" = huge ] && flag=--huge-tmpfs
  fits 100 || { echo "$3 $1 $2 left out $(date -u +%T)"; return; }
  cd $T && PYTHONPATH=$T timeout 150 $P bench/bench_sharded_restore.py $flag --out $out \
    > $L/sharded_$2_$1_$3.log 2>&1
  echo "$3 $1 $2 rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
}
cd /work/wt/restore36 && timeout 150 $P -m pytest -q -p no:cacheprovider tests/unit/test_slot_rows.py tests/unit/test_restore_scratch.py tests/unit/test_worker_shards.py tests/unit/test_store_peer_restore.py tests/unit/test_restore_own_shard.py tests/unit/test_class_sizes.py tests/unit/test_import_contracts.py > $O/tests_new.txt 2>&1
echo "tests new rc=$? $(date -u +%T)"
cd /work/wt/restore36 && PYTHONPATH=/work/wt/restore36 timeout 150 $P bench/bench_peer_restore.py --out $O/peer_restore.json > $L/peer_restore.log 2>&1
echo "peer rc=$? $(date -u +%T)"
run new shm 1; run old shm 2; run old huge 3; run new huge 4
run new shm 5; run old shm 6; run new huge 7; run old huge 8
run new shm 9; run old shm 10
echo "hold end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

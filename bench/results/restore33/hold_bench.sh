#!/bin/bash
# hold_bench.sh SECONDS [chaos]: inside a CPU hold, runs what fits in SECONDS of the sharded
# restore A/B: bench_sharded_restore.py at its defaults from two pinned copies, /tmp/r33/base
# (git archive 61ae2d7: main, one range a FETCH, protocol v6) and /tmp/r33/v7 (git archive
# bc93809, this branch: several ranges a FETCH), each run from inside its copy with PYTHONPATH
# set to it (restore32's way), interleaved: /dev/shm v7 base, huge pages base v7, /dev/shm
# base v7, huge pages v7 base. A run whose result exists is not run again (the runs were
# split over two holds: restore33's README says which). With "chaos": then the corrupt-replica
# and FSDP2 kill -9 chaos tests on this worktree, if they fit, and then one more interleaved
# round of four runs (9-12) as far as it fits.
W=/work/wt/restore33; O=$W/bench/results/restore33; L=/tmp/r33/bench
P=$W/.venv/bin/python   # this worktree's venv; elasticd comes from PYTHONPATH
mkdir -p $L
START=$(date -u +%s); END=$((START + $1))
HARD=$(date -u -d "19:58:30" +%s); [ $END -gt $HARD ] && END=$HARD  # the session's deadline
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
echo "bench start $(date -u +%T) end by $(date -u -d @$END +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
sharded() {  # sharded <pages: shm|huge> <tree: v7|base> <run number>
  local T=/tmp/r33/$2 opt="" out=$O/sharded_$1_$2_$3.json
  [ -e $out ] && return
  [ "$1" = huge ] && opt=--huge-tmpfs
  fits 130 || { echo "$3 $1 $2 left for later $(date -u +%T)"; return; }
  cd $T && PYTHONPATH=$T timeout 150 $P bench/bench_sharded_restore.py $opt \
    --out $out > $L/sharded_$1_$2_$3.log 2>&1
  echo "$3 $1 $2 rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
}
if [ "$2" = chaos ]; then  # first, the reworked multi-range test on this branch and on the old code
  cd $W && timeout 60 $P -m pytest -q -p no:cacheprovider tests/unit/test_multi_range_fetch.py > /tmp/r33/t/multi_new.txt 2>&1
  echo "multi-range test, this branch rc=$? $(date -u +%T)"
  cd /tmp/r33/oldcheck && PYTHONPATH=/tmp/r33/oldcheck timeout 60 $P -m pytest -q -p no:cacheprovider tests/unit/test_multi_range_fetch.py > /tmp/r33/t/multi_old.txt 2>&1
  echo "multi-range test, old code rc=$? $(date -u +%T)"
fi
sharded shm v7 1; sharded shm base 2; sharded huge base 3; sharded huge v7 4
sharded shm base 5; sharded shm v7 6; sharded huge v7 7; sharded huge base 8
echo "bench end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"
if [ "$2" = chaos ] && fits 200; then
  cd $W && timeout $(( END - $(date -u +%s) )) $P -m pytest -q -p no:cacheprovider \
    tests/chaos/test_corrupt_replica.py \
    "tests/chaos/test_sharded_reshard.py::test_fsdp2_kill9_node_reshards_from_peer_ram_bitwise_like_dcp_load" \
    > /tmp/r33/t/chaos.txt 2>&1
  echo "chaos rc=$? $(date -u +%T)"
fi
if [ "$2" = chaos ]; then
  sharded shm v7 9; sharded shm base 10; sharded huge base 11; sharded huge v7 12
  echo "extra end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"
fi

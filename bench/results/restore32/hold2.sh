#!/bin/bash
# Hold 2 (one ticket, queued at 16:00 UTC behind three others; runs whatever fits before the
# session's deadline, at most 25 min): (1) piece_cost.py (it failed: the copy had no such file;
# the script was not kept); (2) the strict same-hold A/B of 1 MiB vs 512 KiB checksum
# blocks that restore31 owed: the sharded restore bench at its defaults from two pinned copies,
# /tmp/r32/tree-1m (git archive d467747, this branch's base) and /tmp/r32/tree-512k (the same
# with DEFAULT_BLOCK_SIZE = 512 << 10, ef6d9d7's one-line change), each run from inside its copy
# with PYTHONPATH set to it (bench/code_tree.py pins it; each result's "code" names the copy),
# in ABBA pairs: /dev/shm, huge pages, /dev/shm, huge pages.
W=/work/wt/restore32; O=$W/bench/results/restore32; L=/tmp/r32/h3
P=/work/main/.venv/bin/python   # main's venv: the same packages; elasticd comes from PYTHONPATH
START=$(date -u +%s); END=$((START + 1500))
HARD=$(date -u -d "16:58:00" +%s); [ $END -gt $HARD ] && END=$HARD
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
echo "start $(date -u +%T) end by $(date -u -d @$END +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
if fits 90; then
  cd /tmp/r32/tree-1m/bench
  PYTHONPATH=/tmp/r32/tree-1m timeout 120 $P results/restore32/piece_cost.py --repeat 3 \
    > $O/piece_cost.json 2> $L/piece_cost.err
  echo "piece_cost rc=$? $(date -u +%T)"
fi
# (The loop as run was restore31's hold2.sh loop; written here as a function after the run, the
# same commands in the same order.)
sharded() {  # sharded <pages: shm|huge> <tree: 1m|512k> <run number>
  local T=/tmp/r32/tree-$2 opt=""
  [ "$1" = huge ] && opt=--huge-tmpfs
  fits 130 || { echo "$3 $1 $2 skipped (would not fit) $(date -u +%T)"; return; }
  cd $T && PYTHONPATH=$T timeout 170 $P bench/bench_sharded_restore.py $opt \
    --out $O/sharded_$1_$2_$3.json > $L/sharded_$1_$2_$3.log 2>&1
  echo "$3 $1 $2 rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
}
sharded shm 1m 1; sharded shm 512k 2; sharded huge 512k 3; sharded huge 1m 4
sharded shm 1m 5; sharded shm 512k 6; sharded huge 512k 7; sharded huge 1m 8
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

#!/bin/bash
# restore38's A/B hold: bench_sharded_restore.py at its defaults, the new tree (NEW, a copy of
# this change) and the old one (main e0f6343) interleaved, alternating /dev/shm and
# --huge-tmpfs, ROUNDS pairs (default 4). Each tree is a copy in /tmp/r38, run from inside
# itself with PYTHONPATH set to it; both run the same bench (new's copy), so each result's
# "code" names the elasticd it imported. Run as:
#   /work/wt/cpulock bash bench/results/restore38/ab/hold.sh [ROUNDS] [OUT]
set -u
R=/work/main; ROUNDS=${1:-4}; O=${2:-$R/bench/results/restore38/ab}; L=/tmp/r38/logs
P=$R/.venv/bin/python
mkdir -p $L $O
[ -d /tmp/r38/new ] || { echo "copy the new tree to /tmp/r38/new first"; exit 2; }
rm -rf /tmp/r38/old; mkdir -p /tmp/r38/old
git -C $R archive e0f6343 | tar -x -C /tmp/r38/old
cp /tmp/r38/new/bench/bench_sharded_restore.py /tmp/r38/new/bench/verified_floor.py /tmp/r38/new/bench/proc_cpu.py /tmp/r38/old/bench/
echo "hold start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) rounds: $ROUNDS old: e0f6343"
k=0
for i in $(seq 1 $ROUNDS); do
  pages=shm; [ $((i % 2)) = 0 ] && pages=huge
  order="new old"; [ $((i % 4)) -ge 2 ] && order="old new"
  for tree in $order; do
    k=$((k + 1)); flag=""; [ $pages = huge ] && flag=--huge-tmpfs
    T=/tmp/r38/$tree
    cd $T && PYTHONPATH=$T timeout 200 $P bench/bench_sharded_restore.py $flag \
      --out $O/sharded_${pages}_${tree}_$k.json > $L/sharded_${pages}_${tree}_$k.log 2>&1
    rc=$?
    tail -3 $L/sharded_${pages}_${tree}_$k.log > $O/sharded_${pages}_${tree}_$k.tail
    echo "$k $tree $pages rc=$rc $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
echo "hold end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

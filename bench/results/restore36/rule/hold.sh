#!/bin/bash
# The lead's hold after restore36's A/B: bench_sharded_restore.py at its defaults on the new
# tree only (restore36 96c320a..fe58a69, committed), alternating /dev/shm and --huge-tmpfs,
# 4 runs each, to see whether every run is <= 1.5x the verified floor (timed rounds, first
# round, CPU per restore). Run as: /work/wt/cpulock bash bench/results/restore36/rule/hold.sh
O=/work/wt/restore36/bench/results/restore36/rule; L=/tmp/r36/rule
P=/work/wt/restore36/.venv/bin/python T=/work/wt/restore36
echo "hold start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) code: $(git -C $T rev-parse --short HEAD)"
for k in 1 2 3 4 5 6 7 8; do
  pages=shm flag=""; [ $((k % 2)) = 0 ] && { pages=huge; flag=--huge-tmpfs; }
  cd $T && PYTHONPATH=$T timeout 240 $P bench/bench_sharded_restore.py $flag \
    --out $O/sharded_${pages}_new_$k.json > $L/sharded_${pages}_new_$k.log 2>&1
  echo "$k $pages rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
done
echo "hold end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

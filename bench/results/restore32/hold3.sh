#!/bin/bash
# Hold 3 (queued after hold 2 ended): piece_cost.py from the base tree's copy (hold 2 could not
# find it there), then more 1 MiB / 512 KiB pairs of the sharded bench as hold 2 ran them, each
# only if it ends before 16:57 UTC.
END=$(date -u -d "16:57:00" +%s)
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
O=/work/wt/restore32/bench/results/restore32; L=/tmp/r32/h4; P=/work/main/.venv/bin/python
fits 60 || { echo "too late $(date -u +%T)"; exit 0; }
echo "start $(date -u +%T)"
cd /tmp/r32/tree-1m/bench
PYTHONPATH=/tmp/r32/tree-1m timeout 150 $P results/restore32/piece_cost.py --repeat 3 \
  > $O/piece_cost.json 2> $L/piece_cost.err
echo "piece_cost rc=$? $(date -u +%T)"
k=8
for run in shm:512k shm:1m huge:1m huge:512k; do
  pages=${run%%:*}; tree=${run##*:}; k=$((k + 1))
  T=/tmp/r32/tree-$tree
  opt=$([ $pages = huge ] && echo --huge-tmpfs || echo)
  if fits 100; then
    cd $T
    PYTHONPATH=$T timeout 150 $P bench/bench_sharded_restore.py $opt \
      --out $O/sharded_${pages}_${tree}_$k.json > $L/sharded_${pages}_${tree}_$k.log 2>&1
    echo "$k $pages $tree rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  else echo "$k $pages $tree skipped (would not fit) $(date -u +%T)"; fi
done
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

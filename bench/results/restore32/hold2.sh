#!/bin/bash
# Hold 2 (one ticket, queued at 16:00 UTC behind three others; runs whatever fits before the
# session's deadline, at most 25 min): (1) piece_cost.py, what one fetch request costs beside
# its bytes (fetcher and holders); (2) the strict same-hold A/B of 1 MiB vs 512 KiB checksum
# blocks that restore31 owed: the sharded restore bench at its defaults from two pinned copies,
# /tmp/r32/tree-1m (git archive d467747, this branch's base) and /tmp/r32/tree-512k (the same
# with DEFAULT_BLOCK_SIZE = 512 << 10, ef6d9d7's one-line change), each run from inside its copy
# with PYTHONPATH set to it (bench/code_tree.py pins it; each result's "code" names the copy),
# in ABBA order: /dev/shm, then huge pages, then /dev/shm again.
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
k=0
for run in shm:1m shm:512k huge:512k huge:1m shm:1m shm:512k huge:512k huge:1m; do
  pages=${run%%:*}; tree=${run##*:}; k=$((k + 1))
  T=/tmp/r32/tree-$tree
  opt=$([ $pages = huge ] && echo --huge-tmpfs || echo)
  if fits 130; then
    cd $T
    PYTHONPATH=$T timeout 170 $P bench/bench_sharded_restore.py $opt \
      --out $O/sharded_${pages}_${tree}_$k.json > $L/sharded_${pages}_${tree}_$k.log 2>&1
    echo "$k $pages $tree rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  else echo "$k $pages $tree skipped (would not fit) $(date -u +%T)"; fi
done
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

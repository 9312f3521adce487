#!/bin/bash
# restore39's hold of main as it stands (no change on the restore path this session): both
# issue-30 benches at their defaults, RUNS sharded runs (/dev/shm and --huge-tmpfs alternated)
# then PEER peer-restore runs. Run as:
#   /work/wt/cpulock bash bench/results/restore39/hold.sh [RUNS] [PEER]
set -u
R=/work/main; RUNS=${1:-8}; PEER=${2:-3}; O=${HOLD_OUT:-$R/bench/results/restore39/hold}; P=$R/.venv/bin/python
L=${HOLD_LOGS:-/tmp/r39/logs}; mkdir -p $O $L; cd $R
echo "hold start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) tree: $(git rev-parse --short HEAD)"
for k in $(seq 1 $RUNS); do
  pages=shm; flag=""; [ $((k % 2)) = 0 ] && { pages=huge; flag=--huge-tmpfs; }
  timeout 400 $P bench/bench_sharded_restore.py $flag --out $O/sharded_${pages}_main_$k.json \
    > $L/sharded_$k.log 2>&1
  echo "$k $pages rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  tail -3 $L/sharded_$k.log > $O/sharded_${pages}_main_$k.tail
done
for k in $(seq 1 $PEER); do
  timeout 300 $P bench/bench_peer_restore.py --out $O/peer_$k.json 2>&1 | grep -E "runs at" | sed "s/^/peer $k: /"
done
echo "hold end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd) mounts: $(grep -c elasticd-bench /proc/mounts)"

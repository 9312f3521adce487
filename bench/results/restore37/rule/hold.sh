#!/bin/bash
# restore37's hold (<= 20 min): bench_sharded_restore.py at its defaults, alternating /dev/shm
# and --huge-tmpfs, this branch's tree (new) and main 3d70f93 (old) interleaved, as many runs
# as fit; no run starts after 1000 s. Each tree is a `git archive` copy in /tmp/r37, run from
# inside itself with PYTHONPATH set to it; both run this branch's bench (its additions only
# report: paired CPU per round, scratch counters; it reads an elasticd without them as 0), so
# each result's "code" names the elasticd it imported. Run as:
#   /work/wt/cpulock bash bench/results/restore37/rule/hold.sh
set -u
W=/work/wt/restore37; O=$W/bench/results/restore37/rule; L=/tmp/r37/logs
P=$W/.venv/bin/python
rm -rf /tmp/r37/new /tmp/r37/old; mkdir -p /tmp/r37/new /tmp/r37/old $L
git -C $W archive HEAD | tar -x -C /tmp/r37/new
git -C $W archive 3d70f93 | tar -x -C /tmp/r37/old
cp /tmp/r37/new/bench/bench_sharded_restore.py /tmp/r37/new/bench/verified_floor.py /tmp/r37/old/bench/
start=$(date +%s)
echo "hold start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) new: $(git -C $W rev-parse --short HEAD) old: 3d70f93"
k=0
for arm in new:shm new:huge old:shm old:huge new:shm new:huge old:shm old:huge new:shm new:huge old:shm old:huge new:shm new:huge old:shm old:huge; do
  [ $(( $(date +%s) - start )) -lt 1000 ] || break
  k=$((k + 1)); tree=${arm%:*}; pages=${arm#*:}; flag=""; [ $pages = huge ] && flag=--huge-tmpfs
  T=/tmp/r37/$tree
  cd $T && PYTHONPATH=$T timeout 200 $P bench/bench_sharded_restore.py $flag \
    --out $O/sharded_${pages}_${tree}_$k.json > $L/sharded_${pages}_${tree}_$k.log 2>&1
  rc=$?
  cp $L/sharded_${pages}_${tree}_$k.log $O/
  echo "$k $tree $pages rc=$rc $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  if [ $k = 1 ] && [ $rc != 0 ]; then echo "first run failed: stopping"; break; fi
done
echo "hold end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

#!/bin/bash
# Hold 1 (profile): one default run of the sharded bench on /dev/shm (tree d467747, this
# branch's base) under system-wide `perf record -a -F 999` (leaf samples, no call graph), with
# the bench's children listed every 0.5 s so each sample's pid/tid maps to its role: the
# bench forks holders h0..h2 then daemons n0, n1 (in pid order), then spawns the savers and
# the two workers. What the profile is for: where the holders' and daemons' CPU beyond the
# verified floor's senders and receivers goes (kernel copy, Python, Poly1305, ...).
W=/work/wt/restore32; P=${P:-$W/.venv/bin/python}; O=/tmp/r32/h1
cd $W
echo "start $(date -u +%T) $(git log --oneline -1 | cut -c1-60) python=$P"
perf record -a -F 999 -o $O/perf.data > $O/perf.log 2>&1 &
PERF=$!
sleep 1
PYTHONPATH=$W timeout 300 $P bench/bench_sharded_restore.py --out $O/run.json > $O/run.log 2>&1 &
B=$!
while kill -0 $B 2>/dev/null; do
  ps -eo pid=,ppid=,lstart=,args= | awk -v b=$B '$2==b' >> $O/children.txt
  ps -eLo pid=,tid=,args= | awk '$3 ~ /python/' >> $O/threads.txt
  sleep 0.5
done
wait $B; echo "bench rc=$? $(date -u +%T)"
kill -INT $PERF; wait $PERF
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench)"

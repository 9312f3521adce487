#!/bin/bash
O=/tmp/r38/perf; R=/work/main; cd $R
.venv/bin/python bench/bench_sharded_restore.py --repeat 9 --out $O/run.json > $O/run.log 2>&1 &
B=$!
until grep -q "restored step" $O/run.log 2>/dev/null; do sleep 0.2; kill -0 $B 2>/dev/null || exit 1; done
ps --ppid $B -o pid=,lstart=,args= > $O/children.txt
perf record -a -F 999 -o $O/perf.data > $O/perf.log 2>&1 &
P=$!
while kill -0 $B 2>/dev/null; do ps -eLo pid=,tid=,args= | awk '$3 ~ /python/' >> $O/threads.txt; sleep 1; done
wait $B; echo "bench rc=$?"
kill -INT $P; wait $P

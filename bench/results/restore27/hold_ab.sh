#!/bin/sh
cd /work/wt/restore27
P=.venv/bin/python
echo "start $(date -u +%T)"
run() { # name, env...
  name=$1; shift
  env "$@" MB_MIB=1024 MB_ROUNDS=4 timeout 200 $P /tmp/r27/mb.py > /tmp/r27/ab_$name.out 2>&1
  echo "$name rc=$? $(date -u +%T) $(tail -2 /tmp/r27/ab_$name.out | tr '\n' ' ')"
}
run main1 PYTHONPATH=/work/main
run seal1 X=1
run chunk1 MB_PATCH=/tmp/r27/chunk7.py
run main2 PYTHONPATH=/work/main
run seal2 X=1
run chunk2 MB_PATCH=/tmp/r27/chunk7.py
# perf of the holder, main code
PYTHONPATH=/work/main MB_MIB=1024 MB_ROUNDS=3 MB_WAIT=2 timeout 200 $P /tmp/r27/mb.py > /tmp/r27/perf_mb.out 2>&1 &
for i in $(seq 1 30); do PID=$(grep -o "holder pid [0-9]*" /tmp/r27/perf_mb.out | awk '{print $3}'); [ -n "$PID" ] && break; sleep 1; done
perf record -F 999 -g -p $PID -o /tmp/r27/perf_mb.data -- sleep 9 > /tmp/r27/perf_rec.log 2>&1
wait
echo "perf done $(date -u +%T)"

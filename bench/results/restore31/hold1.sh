#!/bin/bash
# Hold 1 (profile): one default run of the sharded bench on /dev/shm with the bench's cProfile
# (--profile: workers' timed restores, every daemon and holder thread) and perf record -g
# (999 Hz) on the two new workers for the whole of their run. As run, the loop below looked
# for the workers under `timeout` instead of the bench's process and found none: perf was
# attached by hand (`perf record -g -F 999 -p <the two workers>`) at ~12:01, after the first
# round; the timed rounds are in it.
W=/work/wt/restore31; P=$W/.venv/bin/python; O=/tmp/r31/h1
cd $W
echo "start $(date -u +%T) $(git log --oneline -1 | cut -c1-60)"
timeout 300 $P bench/bench_sharded_restore.py --profile $O/cprof --out $O/prof.json > $O/prof.log 2>&1 &
B=$!
seen=""; started=0
while kill -0 $B 2>/dev/null; do
  spawn=$(ps -o pid=,args= --ppid $B | grep spawn_main | awk '{print $1}' | sort -n)
  for p in $spawn; do case " $seen " in *" $p "*) ;; *) seen="$seen $p";; esac; done
  n=$(echo $seen | wc -w)
  if [ $started = 0 ] && [ $n -ge 5 ] && [ $(echo "$spawn" | grep -c .) -ge 2 ]; then
    pids=$(echo $spawn | tr ' ' ',')
    echo "workers: $pids $(date -u +%T)"
    ps -o pid=,ppid=,args= --ppid $B > $O/pids.txt
    perf record -g -F 999 -p $pids -o $O/perf.data > $O/perf.log 2>&1 &
    PERF=$!
    started=1
  fi
  sleep 0.2
done
wait $B; echo "bench rc=$? $(date -u +%T)"
[ -n "$PERF" ] && kill -INT $PERF; sleep 2; wait
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench)"

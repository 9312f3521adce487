#!/bin/bash
# Hold 1: where the sharded restore's CPU goes (perf -a + py-spy over one default run of the
# sharded bench on /dev/shm), the worker-copy micro-experiment, then one plain default run.
W=/work/wt/restore28; P=$W/.venv/bin/python; O=/tmp/r28/h1
cd $W
echo "start $(date -u +%T) $(git log --oneline -1 | cut -c1-60)"
$P bench/bench_sharded_restore.py --out $O/prof.json > $O/prof.log 2>&1 &
B=$!
seen=""; started=0
while kill -0 $B 2>/dev/null; do
  kids=$(ps -o pid=,args= --ppid $B)
  spawn=$(echo "$kids" | grep spawn_main | awk '{print $1}' | sort -n)
  for p in $spawn; do case " $seen " in *" $p "*) ;; *) seen="$seen $p";; esac; done
  n=$(echo $seen | wc -w)
  if [ $started = 0 ] && [ $n -ge 5 ] && [ $(echo "$spawn" | grep -c .) -ge 2 ]; then
    forks=$(echo "$kids" | grep -v spawn_main | grep bench_sharded | awk '{print $1}' | sort -n)
    echo "forks: $forks"; echo "spawned: $spawn"
    ps -o pid=,ppid=,args= --ppid $B > $O/pids.txt
    perf record -a -g -F 499 -o $O/perf.data > $O/perf.log 2>&1 &
    PERF=$!
    i=0
    for p in $forks; do
      name=$( [ $i -lt 3 ] && echo holder$i || echo daemon$((i-3)) )
      $W/.venv/bin/py-spy record -p $p -r 97 --nonblocking --threads -f raw -o $O/spy_$name.txt > $O/spy_$name.log 2>&1 &
      i=$((i+1))
    done
    j=0
    for p in $spawn; do
      $W/.venv/bin/py-spy record -p $p -r 97 --nonblocking -f raw -o $O/spy_worker$j.txt > $O/spy_worker$j.log 2>&1 &
      j=$((j+1))
    done
    started=1
    echo "profilers on $(date -u +%T)"
  fi
  sleep 0.3
done
wait $B; echo "prof bench rc=$? $(date -u +%T)"
[ -n "$PERF" ] && kill -INT $PERF; sleep 2; wait
echo "copy experiment $(date -u +%T)"
timeout 120 $P /tmp/r28/copy_exp.py > $O/copy_exp.txt 2>&1; echo "rc=$?"
echo "plain run $(date -u +%T)"
timeout 300 $P bench/bench_sharded_restore.py --out $O/plain_main.json > $O/plain_main.log 2>&1
echo "plain rc=$? $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c -e elasticd-bench -e r28)"

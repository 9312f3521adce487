#!/bin/bash
# Hold 1 (under the CPU lock): the zero-copy micro-experiment (zero_copy_exp.py) at 576 MiB,
# twice, with the machine's load before and after.
W=/work/wt/restore30; P=$W/.venv/bin/python; O=$W/bench/results/restore30
cd $O
echo "start $(date -u +%T) $(cd $W && git log --oneline -1 | cut -c1-60) load: $(cut -d' ' -f1-3 /proc/loadavg)"
for k in 1 2; do
  timeout 240 $P zero_copy_exp.py 2>&1 | grep -v -i warn
  echo "run $k rc=${PIPESTATUS[0]} $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
done
echo "leftover: shm $(ls /dev/shm | grep -c r30) mounts $(mount | grep -c r30-huge) end $(date -u +%T)"

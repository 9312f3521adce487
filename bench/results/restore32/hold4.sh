#!/bin/bash
# Hold 4 (queued at 16:24 UTC behind two other engineers' holds): more pairs of hold 2's A/B
# (the same two pinned copies, the same command: hold2.sh's `sharded`), runs 9 on, each only if
# it ends by 16:56:30 UTC (the results are written up before 17:05).
W=/work/wt/restore32; O=$W/bench/results/restore32; L=/tmp/r32/h5
P=/work/main/.venv/bin/python
END=$(date -u -d "16:56:30" +%s)
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
source <(sed -n '/^sharded() {/,/^}/p' $O/hold2.sh)
echo "start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
sharded shm 512k 9; sharded shm 1m 10; sharded huge 1m 11; sharded huge 512k 12
sharded shm 512k 13; sharded shm 1m 14; sharded huge 1m 15; sharded huge 512k 16
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench) mounts: $(grep -c elasticd-bench /proc/mounts)"

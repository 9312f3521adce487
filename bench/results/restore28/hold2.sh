#!/bin/bash
# Hold 2: the sharded restore bench at its defaults on /dev/shm, this tree (the worker's rows
# read with preadv) against main's (efc60db, a git archive copy on PYTHONPATH), interleaved
# new / main / new / main / new (each run's first round is a first round of both elasticd and
# its verified floor), then the unit suite if it fits.
# Nothing starts that would not end within the hold's 15 minutes.
W=/work/wt/restore28; P=$W/.venv/bin/python; O=$W/bench/results/restore28; M=/tmp/r28/tree-efc60db
START=$(date -u +%s); END=$((START + 870))
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
cd $W
echo "start $(date -u +%T) $(git log --oneline -1 | cut -c1-70) dirty=$(git status --short elasticd | wc -l)"
run() {  # name, tree ("" = this worktree)
  if fits 150; then
    if [ -n "$2" ]; then
      PYTHONPATH=$2 timeout 300 $P bench/bench_sharded_restore.py --out $O/sharded_shm_$1.json > /tmp/r28/h2/$1.log 2>&1
    else
      timeout 300 $P bench/bench_sharded_restore.py --out $O/sharded_shm_$1.json > /tmp/r28/h2/$1.log 2>&1
    fi
    echo "$1 rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  else
    echo "$1 skipped (would not fit) $(date -u +%T)"
  fi
}
top -b -n1 -o %CPU | sed -n 7,12p  # who else runs (nothing heavy should, outside the lock)
run new1 ""
run main1 $M
run new2 ""
run main2 $M
run new3 ""
if fits 300; then
  timeout 420 $P -m pytest -q -x tests/unit -p no:randomly > /tmp/r28/h2/unit.log 2>&1
  echo "unit rc=$? $(tail -1 /tmp/r28/h2/unit.log) $(date -u +%T)"
else
  echo "unit suite skipped (would not fit) $(date -u +%T)"
fi
echo "leftover shm: $(ls /dev/shm | grep -c -e elasticd-bench -e r28) end $(date -u +%T)"

#!/bin/bash
# Hold 2 (bench/results/restore29/hold2.sh runs this once ready): the sharded restore bench at
# its defaults on /dev/shm, twice, on this branch's tree (its elasticd/ is 376703c's); then the
# unit suite; then, if it still fits in the hold's 12 minutes, one run on huge pages.
W=/work/wt/restore29; P=$W/.venv/bin/python; O=$W/bench/results/restore29; L=/tmp/r29/h2
START=$(date -u +%s); END=$((START + 715))
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
cd $W
echo "start $(date -u +%T) $(git log --oneline -1 | cut -c1-70) dirty=$(git status --short elasticd | wc -l)"
top -b -n1 -o %CPU | sed -n 7,11p
for k in 1 2; do
  if fits 170; then
    timeout 260 $P bench/bench_sharded_restore.py --out $O/sharded_shm_head$k.json > $L/shm$k.log 2>&1
    echo "shm$k rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  else echo "shm$k skipped $(date -u +%T)"; fi
done
if fits 280; then
  timeout 330 $P -m pytest -q -x tests/unit -p no:randomly > $L/unit.log 2>&1
  echo "unit rc=$? $(tail -1 $L/unit.log) $(date -u +%T)"
else echo "unit skipped $(date -u +%T)"; fi
if fits 170; then
  timeout 200 $P bench/bench_sharded_restore.py --huge-tmpfs --out $O/sharded_huge_head1.json > $L/huge1.log 2>&1
  echo "huge1 rc=$? $(date -u +%T)"
else echo "huge1 skipped (would not fit) $(date -u +%T)"; fi
echo "leftover shm: $(ls /dev/shm | grep -c -e elasticd -e r29) end $(date -u +%T)"

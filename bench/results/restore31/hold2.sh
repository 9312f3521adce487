#!/bin/bash
# Hold 2 (one ticket for the A/B and the tests; queued early, it runs once /tmp/r31/ready names
# the trees): the unit tests of the fetch, replica, store and snapshot paths and the
# corrupt-replica chaos test on this worktree; block_cost.py (what the block size costs a
# snapshot and a receiver); the peer restore bench on the new tree; then the
# sharded restore bench at its defaults, new and base interleaved: /dev/shm, /dev/shm, huge
# pages, huge pages, /dev/shm, /dev/shm (new first in each pair), as long as the hold's 14
# minutes allow. new = this branch's tree, base = 2bcbcc8 (this branch's parent), each a
# git archive in /tmp/r31/tree-<commit>, run from inside it with PYTHONPATH set to it.
W=/work/wt/restore31; P=$W/.venv/bin/python; O=$W/bench/results/restore31; L=/tmp/r31/h2
[ -f /tmp/r31/ready ] || sleep 20
[ -f /tmp/r31/ready ] || { echo "not ready $(date -u +%T)"; exit 3; }
START=$(date -u +%s); END=$((START + 830))
HARD=$(date -u -d "13:19" +%s); [ $END -gt $HARD ] && END=$HARD  # the session's deadline
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
NEW=$(sed -n 1p /tmp/r31/ready); BASE=$(sed -n 2p /tmp/r31/ready)  # /tmp/r31/tree-<commit>
echo "start $(date -u +%T) new=$NEW base=$BASE worktree=$(cd $W && git log --oneline -1 | cut -c1-8) dirty=$(cd $W && git status --short elasticd tests | wc -l)"
cd $W
fits 200 || { echo "no time for anything $(date -u +%T)"; exit 4; }
timeout 200 $P -m pytest -q -p no:randomly tests/unit/test_fetch_ranges.py tests/unit/test_fetch_deadline.py \
  tests/unit/test_striped_fetch.py tests/unit/test_replicator.py tests/unit/test_replication_*.py \
  tests/unit/test_snapshot_format.py tests/unit/test_store_shm.py tests/unit/test_store_peer_restore.py \
  tests/chaos/test_corrupt_replica.py > $L/tests.log 2>&1
echo "tests rc=$? $(tail -1 $L/tests.log) $(date -u +%T)"
timeout 60 $P bench/results/restore31/block_cost.py > $O/block_cost.json 2> $L/block_cost.err
echo "block_cost rc=$? $(date -u +%T)"
cd $NEW
if fits 150; then
  PYTHONPATH=$NEW timeout 240 $P bench/bench_peer_restore.py --out $O/peer_new.json > $L/peer_new.log 2>&1
  echo "peer_new rc=$? $(date -u +%T)"
else echo "peer_new skipped $(date -u +%T)"; fi
k=0
for run in shm:new shm:base huge:new huge:base shm:new shm:base; do
  pages=${run%%:*}; tree=${run##*:}; k=$((k + 1))
  T=$([ $tree = new ] && echo $NEW || echo $BASE)
  opt=$([ $pages = huge ] && echo --huge-tmpfs || echo)
  if fits 140; then
    cd $T
    PYTHONPATH=$T timeout 200 $P bench/bench_sharded_restore.py $opt \
      --out $O/sharded_${pages}_${tree}_$k.json > $L/sharded_${pages}_${tree}_$k.log 2>&1
    echo "$k $pages $tree rc=$? $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  else echo "$k $pages $tree skipped (would not fit) $(date -u +%T)"; fi
done
echo "end $(date -u +%T) leftover shm: $(ls /dev/shm | grep -c elasticd-bench)"

#!/bin/sh
# Final hold: both restore benches at their defaults on this tree (sharded on /dev/shm and on
# huge pages), the unit suite and the tests the change touches, then the sharded /dev/shm bench
# on main's tree as the A/B. A step that would not end by 00:49 UTC is skipped.
W=/work/wt/restore27
P=$W/.venv/bin/python
O=$W/bench/results/restore27
END=$(date -u -d "00:49" +%s)
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
cd $W
echo "start $(date -u +%T) $(git -C $W log --oneline -1) dirty=$(git -C $W status --short elasticd | wc -l)"
if fits 120; then
  timeout 300 $P bench/bench_sharded_restore.py --out $O/sharded_shm.json > $O/sharded_shm.log 2>&1
  echo "sharded shm rc=$? $(date -u +%T)"
fi
if fits 120; then
  timeout 300 $P bench/bench_sharded_restore.py --huge-tmpfs --out $O/sharded_huge.json > $O/sharded_huge.log 2>&1
  echo "sharded huge rc=$? $(date -u +%T)"
fi
if fits 260; then
  timeout 400 $P -m pytest -q -x tests/unit -p no:randomly > /tmp/r27/unit.log 2>&1
  echo "unit rc=$? $(tail -1 /tmp/r27/unit.log) $(date -u +%T)"
fi
if fits 75; then
  timeout 200 $P bench/bench_peer_restore.py --out $O/peer.json > $O/peer.log 2>&1
  echo "peer rc=$? $(date -u +%T)"
fi
if fits 120; then
  timeout 300 $P -m pytest -q -x -p no:randomly tests/chaos/test_frozen_holder.py tests/chaos/test_corrupt_replica.py > /tmp/r27/chaos.log 2>&1
  echo "chaos rc=$? $(tail -1 /tmp/r27/chaos.log) $(date -u +%T)"
fi
if fits 120; then
  PYTHONPATH=/work/main timeout 300 $P bench/bench_sharded_restore.py --out $O/sharded_shm_main.json > $O/sharded_shm_main.log 2>&1
  echo "sharded shm main rc=$? $(date -u +%T)"
fi
echo "leftover shm: $(ls /dev/shm | grep -c elasticd-bench) end $(date -u +%T)"

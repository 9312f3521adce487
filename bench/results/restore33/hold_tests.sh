#!/bin/bash
# Test hold 1 (<= 8 min): the new tests on the old code (must fail), the touched unit tests,
# the class-size / import checks and collection; then the first sharded bench runs that fit.
W=/work/wt/restore33; P=$W/.venv/bin/python; O=/tmp/r33/t
S=$(date -u +%s)
echo "start $(date -u +%T)"
cd /tmp/r33/oldcheck && PYTHONPATH=/tmp/r33/oldcheck timeout 60 $P -m pytest -q -p no:cacheprovider \
  tests/unit/test_multi_range_fetch.py tests/unit/test_replication_ranged_fetch.py tests/unit/test_replication_wire.py > $O/old.txt 2>&1
echo "old code rc=$? $(date -u +%T)"
cd $W && timeout 200 $P -m pytest -q -p no:cacheprovider tests/unit/test_replication_*.py tests/unit/test_multi_range_fetch.py \
  tests/unit/test_striped_fetch.py tests/unit/test_replicator.py tests/unit/test_fetch_ranges.py \
  tests/unit/test_fetch_deadline.py tests/unit/test_store_peer_restore.py tests/unit/test_restore_scratch.py \
  tests/unit/test_restore_unreachable_daemon.py tests/unit/test_metrics_replication.py > $O/unit.txt 2>&1
U=$?
echo "unit rc=$U $(date -u +%T)"
cd $W && timeout 60 $P -m pytest -q -p no:cacheprovider tests/unit/test_class_sizes.py tests/unit/test_import_contracts.py > $O/sizes.txt 2>&1
echo "sizes rc=$? $(date -u +%T)"
cd $W && timeout 90 $P -m pytest --co -q -p no:cacheprovider tests > $O/collect.txt 2>&1
echo "collect rc=$? $(date -u +%T)"
LEFT=$(( S + 465 - $(date -u +%s) ))
[ $U = 0 ] && [ $LEFT -gt 100 ] && bash /tmp/r33/hold_bench.sh $LEFT
echo "end $(date -u +%T)"

#!/bin/bash
cd /work/wt/restore36
echo "start $(date -u +%T)"
timeout 170 .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_worker_shards.py tests/unit/test_slot_rows.py > bench/results/restore36/tests_after.txt 2>&1
echo "tests rc=$? $(date -u +%T)"
cd bench/spikes && timeout 30 ../../.venv/bin/python kept_mapping.py --mib 8 --reps 2 > /tmp/r36/spike_small.json 2>&1
echo "spike rc=$? $(date -u +%T)"
cd /work/wt/restore36
before=$(ls /dev/shm | grep -c elasticd-bench-shard)
timeout -k 10 -s TERM 12 .venv/bin/python bench/bench_sharded_restore.py --mib 64 --repeat 1 > /tmp/r36/term.log 2>&1
rc=$?; sleep 2
echo "bench SIGTERM at 12 s rc=$rc left in /dev/shm: $(( $(ls /dev/shm | grep -c elasticd-bench-shard) - before )) /tmp: $(ls /tmp | grep -c elasticd-bench-shard) procs: $(pgrep -fc 'bench_sharded_restore|multiprocessing.spawn') $(date -u +%T)"

#!/bin/bash
M=/tmp/r35/huge; mkdir -p $M
mount -t tmpfs -o huge=within_size,size=4G,mode=0700 tmpfs $M || exit 1
cd /work/wt/restore35
echo "start $(date -u +%T)"
timeout 150 /work/wt/restore35/.venv/bin/python bench/spikes/worker_copy.py --mib 576 --reps 5 --huge $M --out /tmp/r35/spike2.json > /tmp/r35/spike2.out 2>&1
echo "spike rc=$? $(date -u +%T)"
umount $M; rmdir $M
timeout 120 .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_slot_rows.py > /tmp/r35/t_new.txt 2>&1
echo "tests new rc=$? $(date -u +%T)"
cd /tmp/r35/oldcheck && PYTHONPATH=/tmp/r35/oldcheck timeout 120 /work/wt/restore35/.venv/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_slot_rows.py > /tmp/r35/t_old.txt 2>&1
echo "tests old rc=$? $(date -u +%T)"

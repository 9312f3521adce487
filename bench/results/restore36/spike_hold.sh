#!/bin/bash
set -e
cd /work/wt/restore36
M=$(mktemp -d /tmp/r36-huge.XXXX)
mount -t tmpfs -o huge=within_size,size=2G,mode=0700 tmpfs "$M"
trap 'umount "$M"; rmdir "$M"' EXIT
date -u
.venv/bin/python bench/spikes/kept_mapping.py --mib 576 --reps 7 --huge "$M" --out bench/results/restore36/kept_mapping.json
date -u

#!/bin/bash
# Hold 2 (placeholder until ready: exits at once if /tmp/r29/h2.ready is absent).
[ -f /tmp/r29/h2.ready ] || { echo "not ready $(date -u +%T)"; exit 3; }
exec bash /tmp/r29/h2/run.sh

#!/bin/bash
# restore40's hold of main (the fetch path changed only in its failure reasons and its last
# header check): restore39's hold script, its results written here. Run as:
#   /work/wt/cpulock bash bench/results/restore40/hold.sh [RUNS] [PEER]
HOLD_OUT=/work/main/bench/results/restore40/hold HOLD_LOGS=/tmp/r40/logs \
  exec bash /work/main/bench/results/restore39/hold.sh "$@"

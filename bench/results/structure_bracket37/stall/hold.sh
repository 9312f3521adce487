#!/bin/bash
# The bracket's training-visible stall per snapshot with more snapshots than run_all's: each
# tree's bench_checkpoint.py (no replication, ROUNDS rounds of 10 steps: 10 x ROUNDS snapshots
# per mode and run) on the base and the head, each a detached worktree with PYTHONPATH
# set to it, in the order "base head head base base head head base".
# Usage (from the repository):
#   /work/wt/cpulock bash bench/results/structure_bracket37/stall/hold.sh BASE HEAD [ROUNDS] [OUT]
# (OUT: where the results go, by default this directory)
set -u
repo=$(git rev-parse --show-toplevel); out=$(realpath -m "${4:-$repo/bench/results/structure_bracket37/stall}")
py=$repo/.venv/bin/python rounds=${3:-6}
mkdir -p "$out"
declare -A rev=([base]=$1 [head]=$2) n=()
for t in base head; do
    git -C "$repo" worktree remove --force /tmp/stall37/$t 2>/dev/null
    git -C "$repo" worktree add -q --detach /tmp/stall37/$t "${rev[$t]}" || exit 1
done
for t in base head head base base head head base; do
    n[$t]=$(( ${n[$t]:-0} + 1 )); dir=/tmp/stall37/$t
    (cd $dir && PYTHONPATH=$dir $py -c 'import elasticd; print("code:", elasticd.__file__)' \
        && PYTHONPATH=$dir $py bench/bench_checkpoint.py --steps 10 --rounds "$rounds" \
            --json $out/${t}_${n[$t]}.json) > $out/${t}_${n[$t]}.log 2>&1
    rc=$?
    echo "$(date -u +%T) $t-${n[$t]} $(git -C $dir rev-parse --short HEAD) rc=$rc" | tee -a $out/order.txt
done
for t in base head; do git -C "$repo" worktree remove --force /tmp/stall37/$t; done

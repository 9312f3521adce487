#!/bin/bash
# Where the bracket's +10 % training-visible stall per snapshot comes from: bench_checkpoint.py
# (no replication, 4 rounds of 10 steps) on the base, on the Checkpointer's split into
# parts (20de3a2, issue 28) and its parent, and on the head, each a detached worktree with
# PYTHONPATH set to it, in the order "base pre split head head split pre base".
# Usage (from the repository): /work/wt/cpulock bash bench/results/structure_bracket36/stall/hold.sh HEAD
set -u
repo=$(git rev-parse --show-toplevel); out=$repo/bench/results/structure_bracket36/stall
py=$repo/.venv/bin/python
declare -A rev=([base]=a21f20f [pre]=20de3a2^ [split]=20de3a2 [head]=$1) n=()
for t in base pre split head; do
    git -C "$repo" worktree remove --force /tmp/stall36/$t 2>/dev/null
    git -C "$repo" worktree add -q --detach /tmp/stall36/$t "${rev[$t]}" || exit 1
done
for t in base pre split head head split pre base; do
    n[$t]=$(( ${n[$t]:-0} + 1 )); dir=/tmp/stall36/$t
    (cd $dir && PYTHONPATH=$dir $py bench/bench_checkpoint.py --steps 10 --rounds 4 \
        --json $out/${t}_${n[$t]}.json) > $out/${t}_${n[$t]}.log 2>&1
    rc=$?
    echo "$(date -u +%T) $t-${n[$t]} $(git -C $dir rev-parse --short HEAD) rc=$rc" | tee -a $out/order.txt
done
for t in base pre split head; do git -C "$repo" worktree remove --force /tmp/stall36/$t; done

#!/bin/bash
# Issue 28's before/after bracket: bench/run_all.py on the issue's base and on the head, in one
# CPU-lock hold, blocks alternated (base, head, head, base). Each tree is a detached git
# worktree (so run_all records its commit), run with PYTHONPATH set to it; the daemons, agents
# and workers it starts inherit that path. Usage (from the repository):
#   /work/wt/cpulock bash bench/results/structure_bracket36/hold.sh BASE HEAD OUT_DIR [ROUNDS]
#       [ONLY (run_all's --only; "" for every benchmark)] [ORDER (default "base head head base")]
# Environment: EXTRA, more run_all options (e.g. EXTRA="--ttls 4 --runs 12"); RUN, a script of
# this repository with its options to run instead of run_all, on each tree's elasticd, its
# --out being OUT_DIR/<block>.json (e.g. RUN="bench/bench_detection.py --runs 12 --ttl 4").
set -u
base=$1 head=$2 out=$(realpath -m "$3") rounds=${4:-8} only=${5:-} order=${6:-base head head base}
repo=$(git rev-parse --show-toplevel)
py=${PY:-$repo/.venv/bin/python}
mkdir -p "$out"
for t in base head; do
    rev=${!t}; dir=/tmp/bracket36/$t
    git -C "$repo" worktree remove --force "$dir" 2>/dev/null
    git -C "$repo" worktree add -q --detach "$dir" "$rev" || exit 1
done
declare -A n=([base]=0 [head]=0)
for t in $order; do
    n[$t]=$((n[$t] + 1)); label=$t-${n[$t]} dir=/tmp/bracket36/$t
    echo "$(date -u +%T) start $label $t $(git -C "$dir" rev-parse --short HEAD)" | tee -a "$out/order.txt"
    (cd "$dir" && PYTHONPATH=$dir "$py" -c 'import elasticd; print("code:", elasticd.__file__)' \
        && if [ -n "${RUN:-}" ]; then PYTHONPATH=$dir "$py" $repo/$RUN --out "$out/$label.json"
           else PYTHONPATH=$dir "$py" bench/run_all.py --rounds "$rounds" ${only:+--only "$only"} \
                ${EXTRA:-} --out-dir "$out/$label"; fi) \
        > "$out/$label.log" 2>&1
    echo "$(date -u +%T) end $label rc=$?" | tee -a "$out/order.txt"
done
for t in base head; do git -C "$repo" worktree remove --force /tmp/bracket36/$t; done

#!/bin/bash
# Detection at TTL 4 s on the issue's base and the head, in one CPU-lock hold, blocks
# alternated (base head head base), with THIS tree's bench/bench_detection.py for both (it also
# times elasticd's own part: from the victim's record expiring to the failure event). Each tree
# is a detached git worktree imported through PYTHONPATH (the daemons inherit it); each log
# opens with the elasticd it imported. Usage (from the repository):
#   /work/wt/cpulock bash bench/results/structure_bracket37/detection_hold.sh BASE HEAD OUT [RUNS]
set -u
base=$1 head=$2 out=$(realpath -m "$3") runs=${4:-12}
repo=$(git rev-parse --show-toplevel)
py=${PY:-$repo/.venv/bin/python}
mkdir -p "$out"
for t in base head; do
    rev=${!t}; dir=/tmp/bracket37/$t
    git -C "$repo" worktree remove --force "$dir" 2>/dev/null
    git -C "$repo" worktree add -q --detach "$dir" "$rev" || exit 1
done
declare -A n=([base]=0 [head]=0)
for t in base head head base; do
    n[$t]=$((n[$t] + 1)); label=$t-${n[$t]} dir=/tmp/bracket37/$t
    echo "$(date -u +%T) start $label $t $(git -C "$dir" rev-parse --short HEAD)" | tee -a "$out/order.txt"
    (cd "$dir" && PYTHONPATH=$dir "$py" -c 'import elasticd; print("code:", elasticd.__file__)' \
        && PYTHONPATH=$dir "$py" "$repo/bench/bench_detection.py" --runs "$runs" --ttl 4 \
            --out "$out/$label.json") > "$out/$label.log" 2>&1
    echo "$(date -u +%T) end $label rc=$?" | tee -a "$out/order.txt"
done
for t in base head; do git -C "$repo" worktree remove --force /tmp/bracket37/$t; done

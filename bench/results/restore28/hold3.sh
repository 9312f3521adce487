#!/bin/bash
# Hold 3: the kill -9 recovery bench (restart path, elasticd only) and the FSDP2 chaos test
# (tests/chaos/test_sharded_reshard.py, kill -9 of a node, reshard 3 -> 2 -> 3), each tree run
# from a git archive copy with PYTHONPATH set to it (and from inside it: its own bench, tests
# and workers): base = 3f48c4f (main before issue 30's first merge, 47047d5^1), head =
# 7a92980 (this branch). Blocks interleaved base, head, head, base; a step that would not end
# within the hold's 15 minutes is skipped.
P=/work/wt/restore28/.venv/bin/python; O=/work/wt/restore28/bench/results/restore28; L=/tmp/r28/h3
START=$(date -u +%s); END=$((START + 880)); STOP=$(date -u -d "04:01" +%s)
[ $STOP -lt $END ] && END=$STOP  # the session's deadline
fits() { [ $(( $(date -u +%s) + $1 )) -le $END ]; }
echo "start $(date -u +%T)"
# The recovery bench's four blocks first, then the chaos test's four (each interleaved), so
# that a hold cut short by the deadline still has one of them whole.
k=0
for tree in 3f48c4f 7a92980 7a92980 3f48c4f; do
  k=$((k + 1)); T=/tmp/r28/tree-$tree
  cd $T
  echo "block $k $tree: elasticd from $(PYTHONPATH=$T $P -c 'import elasticd; print(elasticd.__file__)')"
  if fits 75; then
    PYTHONPATH=$T timeout 150 $P bench/bench_recovery.py --runs 1 --baseline-runs 0 \
      --out $O/recovery_block${k}_$tree.json > $L/recovery_block${k}_$tree.log 2>&1
    echo "  recovery rc=$? $(date -u +%T)"
  else echo "  recovery skipped $(date -u +%T)"; fi
done
k=0
for tree in 3f48c4f 7a92980 7a92980 3f48c4f; do
  k=$((k + 1)); T=/tmp/r28/tree-$tree
  cd $T
  if fits 120; then
    PYTHONPATH=$T timeout 240 $P -m pytest -q -p no:randomly --durations=0 \
      "tests/chaos/test_sharded_reshard.py::test_fsdp2_kill9_node_reshards_from_peer_ram_bitwise_like_dcp_load" \
      > $L/fsdp_block${k}_$tree.log 2>&1
    echo "  block $k $tree fsdp2 chaos rc=$? $(grep -E 'passed|failed' $L/fsdp_block${k}_$tree.log | tail -1) $(date -u +%T)"
  else echo "  block $k $tree fsdp2 chaos skipped $(date -u +%T)"; fi
done
if [ ! -s /tmp/r28/h2/unit.log ] && fits 300; then
  cd /work/wt/restore28
  timeout 420 $P -m pytest -q -x tests/unit -p no:randomly > /tmp/r28/h3/unit.log 2>&1
  echo "unit rc=$? $(tail -1 /tmp/r28/h3/unit.log) $(date -u +%T)"
fi
echo "leftover shm: $(ls /dev/shm | grep -c elasticd) end $(date -u +%T)"

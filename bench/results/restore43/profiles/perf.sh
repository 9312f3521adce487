cd /tmp/ab43/bench
for v in peer floor; do
  ONLY=$v PYTHONPATH=/work/wt/a /work/main/.venv/bin/python bench_peer_restore.py --repeat 12 > /tmp/ab43/perf_$v.log 2>&1 &
  B=$!
  until grep -q GO /tmp/ab43/perf_$v.log 2>/dev/null; do sleep 0.2; done
  H=$(pgrep -P $B | head -1)
  perf record -e cpu-clock -F 2000 -g -p $B,$H -o /tmp/ab43/perf_$v.data -- sleep 4 > /tmp/ab43/perf_rec_$v.log 2>&1
  kill $B 2>/dev/null; wait $B
  pkill -P $B 2>/dev/null
done

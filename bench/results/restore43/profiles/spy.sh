cd /tmp/ab43/bench
PYTHONPATH=/work/wt/a /work/main/.venv/bin/python bench_peer_restore.py --repeat 20 > /tmp/ab43/spy_bench.log 2>&1 &
B=$!
sleep 12
H=$(pgrep -P $B | head -1)
echo "bench $B holder $H"
/tmp/pyspy/bin/py-spy record -d 20 -p $H --threads --nonblocking -r 200 -f raw -o /tmp/ab43/holder.raw > /tmp/ab43/spy.log 2>&1
wait $B

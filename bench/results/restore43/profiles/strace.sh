cd /tmp/ab43/bench
PYTHONPATH=${TREE:-/work/wt/a} /work/main/.venv/bin/python bench_peer_restore.py --repeat 12 > /tmp/ab43/strace_bench.log 2>&1 &
B=$!
sleep 12
H=$(pgrep -P $B | head -1)
echo "bench $B holder $H"
timeout -s INT 15 strace -c -f -p $H -o /tmp/ab43/holder.strace &
timeout -s INT 15 strace -c -f -p $B -o /tmp/ab43/recv.strace &
wait $B

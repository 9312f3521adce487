#!/bin/sh
W=/work/wt/restore25
P=$W/.venv/bin/python
O=$W/bench/results/restore25/ab2
mkdir -p $O
date -u
cd $W && $P -m pytest -q tests/unit -p no:randomly > /tmp/r25_unit.log 2>&1; echo "unit rc=$?"
cd /tmp
for v in pool new; do
  date -u; PYTHONPATH=/tmp/r25/$v $P $W/bench/bench_sharded_restore.py --out $O/sharded_${v}.json > $O/sharded_${v}.log 2>&1
done
for v in pool new; do date -u; PYTHONPATH=/tmp/r25/$v $P $W/bench/bench_peer_restore.py --out $O/peer_${v}.json > $O/peer_${v}.log 2>&1; done
date -u

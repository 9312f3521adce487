"""perf samples of restore38's profiled run (``run.sh``) by holder thread: each holder's
serving threads (one per daemon connection: elasticd's fetches) against its raw-sender thread
(the verified floor's sender), over the same ten rounds (first and nine timed), with the top
symbols. The pids are that run's (``children.txt`` order: holders h0-h2, daemons n0, n1);
each holder's main thread ran only at teardown (unlinking its replicas), so it is left out.

    perf script -i perf.data -F pid,tid,ip,sym,dso > script.txt
    python by_thread.py script.txt
"""

import collections
import re
import sys

HOLDERS = {13986: "h0", 13989: "h1", 13992: "h2"}
FLOOR_SENDERS = {13988, 13991, 13994}  # each holder's raw-sender thread

samples: collections.Counter = collections.Counter()
symbols: dict = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    parts = line.split()
    m = re.match(r"(\d+)/(\d+)", parts[0]) if parts else None
    if not m or int(m.group(1)) not in HOLDERS or m.group(1) == m.group(2):
        continue
    side = "floor sender" if int(m.group(2)) in FLOOR_SENDERS else "elasticd serving"
    samples[HOLDERS[int(m.group(1))], side] += 1
    symbols[side][" ".join(parts[2:-1])[:40]] += 1
for (holder, side), n in sorted(samples.items()):
    print(f"{holder} {side}: {n}")
for side in ("elasticd serving", "floor sender"):
    total = sum(n for (_, s), n in samples.items() if s == side)
    print(f"{side}: {total} samples;", ", ".join(f"{s} {n}" for s, n in symbols[side].most_common(8)))

"""Requests a new rank's daemon makes for the payload of the old rank both new ranks split, on
restore32's header of the sharded bench's layout (runs_per_rank.py there), with one range a
request (v6: each run of wanted blocks cut to the piece size) and with several (v7:
recovery/fetch.py ``pieces``), at the piece size of an unmeasured link and of measured ones:
``PYTHONPATH=. python bench/results/restore33/requests_per_rank.py``."""
import contextlib
import io
import os
import runpy

from elasticd.recovery.fetch import pieces, stripe_size
from elasticd.recovery.ranges import needed_blocks, parse_boxes
from elasticd.snapshot.format import SnapshotHeader, layout

HERE = os.path.dirname(os.path.abspath(__file__))
with contextlib.redirect_stdout(io.StringIO()):  # its own table, printed there
    g = runpy.run_path(os.path.join(HERE, "..", "restore32", "runs_per_rank.py"))
lay = layout(g["specs"], job="j", meta=g["meta"], block_size=1 << 20)
h = SnapshotHeader("j", 1, 0, 1, 3, lay, g["meta"], tuple(range(lay.num_blocks)))
for r in (0, 1):
    b = needed_blocks(h, parse_boxes([[list(map(int, x[0])), x[1], x[2], x[3]]
                                      for x in g["boxes"][r]]))
    wanted = sum(lay.block_range(i)[1] - lay.block_range(i)[0] for i in b)
    for rate in (50e6, 1e9, 3e9):
        per = max(1, -(-stripe_size(wanted, 2, rate) // lay.block_size))
        v6 = sum(len(p) for p in pieces(b, per))  # every run its own request
        v7 = len(pieces(b, per))
        print(f"new rank {r}: {len(b)} blocks; piece size at {rate / 1e6:.0f} MB/s {per} "
              f"blocks: {v6} requests with one range each, {v7} with several")

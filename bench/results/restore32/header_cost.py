"""What a worker's per-restore header work costs (CPU s, min of 20, one process): parsing
a header of one old rank of the sharded bench (17.5 KB, 78 entries, 39 DTensors, 367 blocks),
as ``SnapshotReader`` does, and walking its meta for the DTensor nodes. Run under the CPU lock:
``PYTHONPATH=. python bench/results/restore32/header_cost.py``."""
import time
from elasticd.snapshot.format import SnapshotHeader, TensorSpec, dtensor_nodes, encode_header, layout
from elasticd.snapshot.reader import parse_header, SnapshotReader
def cpu(fn, reps=20):
    best=1e9
    for _ in range(reps):
        t=time.process_time(); fn(); best=min(best,time.process_time()-t)
    return best
dims = [2827, 2831] * 6 + [2827]
specs, nodes = [], {}
for n, (cols, rows) in enumerate(zip(dims, dims[1:])):
    per = -(-rows // 3)
    for kind in ("w", "exp_avg", "exp_avg_sq"):
        nodes[f"{kind}{n}"] = {"@": "dtensor", "shape": [rows, cols], "offsets": [per, 0],
                               "placements": ["S0"], "mesh": [3], "dims": [], "i": len(specs)}
        specs.append(TensorSpec(f"{kind}{n}", "float32", (min(rows, 2 * per) - per, cols)))
        specs.append(TensorSpec(f"{kind}{n}/step", "float32", ()))
meta = {"objects": [["model", "module", nodes]]}
lay = layout(specs, job="j", meta=meta, block_size=1<<20)
h = SnapshotHeader("j", 1, 0, 1, 3, lay, meta, tuple(range(lay.num_blocks)))
raw = encode_header(h)
buf = bytearray(raw) + bytearray(lay.total_size - len(raw))
print("header bytes", len(raw), "blocks", lay.num_blocks)
print("parse_header", cpu(lambda: parse_header(memoryview(buf), job="j", rank=1, world_size=3)))
print("SnapshotReader verify=False", cpu(lambda: SnapshotReader(memoryview(buf), job="j", rank=1, world_size=3, verify=False)))
print("dtensor_nodes walk", cpu(lambda: list(dtensor_nodes(meta))))

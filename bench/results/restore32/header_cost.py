"""What a worker's per-restore header work costs (CPU s, min of 20, one process): parsing
a header of one old rank of the sharded bench (17.5 KB, 78 entries, 39 DTensors, 367 blocks),
as ``SnapshotReader`` does, and walking its meta for the DTensor nodes. Run under the CPU lock:
``PYTHONPATH=. python bench/results/restore32/header_cost.py`` (output: header_cost.txt)."""

import time

from elasticd.snapshot.format import (SnapshotHeader, TensorSpec, dtensor_nodes, encode_header,
                                      layout)
from elasticd.snapshot.reader import SnapshotReader, parse_header


def cpu(fn, reps=20):
    best = 1e9
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def old_rank_one():
    """Old rank 1 of 3 of the bench's 13 layers (2827/2831 wide): each layer's weight and its
    two Adam moments row-sharded, each with a scalar beside it, in that order."""
    dims = [2827, 2831] * 6 + [2827]
    layers = [(n, cols, rows, -(-rows // 3)) for n, (cols, rows) in enumerate(zip(dims, dims[1:]))]
    names = [(f"{kind}{n}", cols, rows, per) for n, cols, rows, per in layers
             for kind in ("w", "exp_avg", "exp_avg_sq")]
    specs = [spec for i, (name, cols, rows, per) in enumerate(names)
             for spec in (TensorSpec(name, "float32", (min(rows, 2 * per) - per, cols)),
                          TensorSpec(f"{name}/step", "float32", ()))]
    nodes = {name: {"@": "dtensor", "shape": [rows, cols], "offsets": [per, 0],
                    "placements": ["S0"], "mesh": [3], "dims": [], "i": 2 * i}
             for i, (name, cols, rows, per) in enumerate(names)}
    meta = {"objects": [["model", "module", nodes]]}
    lay = layout(specs, job="j", meta=meta, block_size=1 << 20)
    return SnapshotHeader("j", 1, 0, 1, 3, lay, meta, tuple(range(lay.num_blocks))), meta


def main():
    h, meta = old_rank_one()
    raw = encode_header(h)
    buf = bytearray(raw) + bytearray(h.layout.total_size - len(raw))
    print("header bytes", len(raw), "blocks", h.layout.num_blocks)
    print("parse_header", cpu(lambda: parse_header(memoryview(buf), job="j", rank=1,
                                                    world_size=3)))
    print("SnapshotReader verify=False", cpu(lambda: SnapshotReader(
        memoryview(buf), job="j", rank=1, world_size=3, verify=False)))
    print("dtensor_nodes walk", cpu(lambda: list(dtensor_nodes(meta))))


if __name__ == "__main__":
    main()

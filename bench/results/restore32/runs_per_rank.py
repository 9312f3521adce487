"""Runs of wanted blocks (one fetch piece each) of the old rank both new ranks split, on a
header of the sharded bench's layout (weights and biases, three tensors each), at 1 MiB and
512 KiB blocks: ``PYTHONPATH=. python bench/results/restore32/runs_per_rank.py``."""
import math
from elasticd.snapshot.format import SnapshotHeader, TensorSpec, layout
from elasticd.recovery.ranges import needed_blocks, parse_boxes
params = 1100 * (1 << 20) / 3 / 4
w = max(7, int(math.sqrt(params / 12))); w -= (w - 1) % 6
dims = [w + 4 * (i % 2) for i in range(13)] + [5]
print(dims)
def chunk(n, parts, i):
    full = -(-n // parts); s = min(i * full, n); return s, max(0, min(n, s + full) - s)
specs, nodes = [], {}
boxes = {0: [], 1: []}
for n, (cols, rows) in enumerate(zip(dims, dims[1:])):
    for shape in ([rows, cols], [rows]):
        o, l = chunk(rows, 3, 1)
        for kind in ("w", "a", "b"):
            name = f"{kind}{n}{len(shape)}"
            nodes[name] = {"@": "dtensor", "shape": shape, "offsets": [o] + [0] * (len(shape) - 1), "placements": ["S0"], "mesh": [3], "dims": [], "i": len(specs)}
            specs.append(TensorSpec(name, "float32", tuple([l] + shape[1:])))
        for r in (0, 1):
            no, nl = chunk(rows, 2, r)
            if all(x[0] != shape for x in boxes[r]): boxes[r].append([shape, ["S0"], [no] + [0] * (len(shape) - 1), [nl] + shape[1:]])
meta = {"objects": [["model", "module", nodes]]}
for bs in (1 << 20, 512 << 10):
    lay = layout(specs, job="j", meta=meta, block_size=bs)
    h = SnapshotHeader("j", 1, 0, 1, 3, lay, meta, tuple(range(lay.num_blocks)))
    for r in (0, 1):
        b = needed_blocks(h, parse_boxes([[list(map(int, x[0])), x[1], x[2], x[3]] for x in boxes[r]]))
        runs = sum(1 for i, x in enumerate(b) if i == 0 or b[i - 1] != x - 1)
        print(bs, "new rank", r, "blocks", len(b), "of", lay.num_blocks, "runs", runs)

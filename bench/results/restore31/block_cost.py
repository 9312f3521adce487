"""What the checksum block size costs a snapshot and a restore's receiver, one process, one
thread, CPU seconds (min of 5): a 385 MiB snapshot (one old rank of the sharded bench; 117
entries, 39 of them DTensors) at 1 MiB, 512 KiB and 256 KiB blocks. Per snapshot (the owner's
seal, every step it snapshots): the xxh3 of every block (``checksum_blocks``) and the block
tags (``BlockTagger.tag``, as the store's tagger makes them at seal time); the header's bytes
and its encode and parse (every reader parses it). Per GiB received (a fetch's or a push's
receiver): each block checked against its tag as its run lands (``RunCheck``, runs of
7 MiB). Run under the CPU lock by hold2.sh; prints JSON."""

import json
import os
import sys
import time

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from elasticd.replication.runs import RunCheck
from elasticd.replication.seal import BlockTagger
from elasticd.snapshot.format import SnapshotHeader, TensorSpec, checksum_blocks, encode_header
from elasticd.snapshot.format import layout
from elasticd.snapshot.reader import parse_header


def cpu(fn, reps=5):
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    dims = [2827, 2831] * 6 + [2827]
    specs, nodes = [], {}
    for n, (cols, rows) in enumerate(zip(dims, dims[1:])):
        per = -(-rows // 3)
        for kind in ("w", "exp_avg", "exp_avg_sq"):
            nodes[f"{kind}{n}"] = {"@": "dtensor", "shape": [rows, cols], "offsets": [per, 0],
                                   "placements": ["S0"], "mesh": [3], "dims": [],
                                   "i": len(specs)}
            specs.append(TensorSpec(f"{kind}{n}", "float32", (min(rows, 2 * per) - per, cols)))
            specs.append(TensorSpec(f"{kind}{n}/step", "float32", ()))  # small entries too
    meta = {"objects": [["model", "module", nodes]]}
    out = {"command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    buf = None
    for bs in (1 << 20, 512 << 10, 256 << 10):
        lay = layout(specs, job="j", meta=meta, block_size=bs)
        if buf is None:
            buf = bytearray(os.urandom(1 << 20)) * (-(-lay.total_size // (1 << 20)))
        view = memoryview(buf)
        sums = checksum_blocks(buf, lay)
        h = SnapshotHeader("j", 1, 0, 1, 3, lay, meta, sums)
        raw = encode_header(h)
        buf[: len(raw)] = raw  # before the payload (data_offset): the checksums stand
        ranges = [lay.block_range(i) for i in range(lay.num_blocks)]
        tagger = BlockTagger(bytes(32))
        tags = tagger.tag(buf, ranges)
        aead = ChaCha20Poly1305(tagger.key(tags.salt))
        payload = lay.total_size - lay.data_offset

        def check_all():
            run = (7 << 20) // bs
            for k in range(0, len(ranges), run):
                part = ranges[k:k + run]
                a, b = part[0][0], part[-1][1]
                rc = RunCheck(aead, a, [(e - s, tags.tag_at(s, e - s)) for s, e in part],
                              view[a:b])
                rc.update(view[a:b])

        gib = payload / (1 << 30)
        out[f"{bs >> 10} KiB"] = {
            "blocks": lay.num_blocks,
            "header_bytes": len(raw),
            "per_snapshot_cpu_s": {
                "xxh3_checksums": round(cpu(lambda: checksum_blocks(buf, lay)), 4),
                "block_tags": round(cpu(lambda: tagger.tag(buf, ranges)), 4),
                "header_encode": round(cpu(lambda: encode_header(h)), 5),
                "header_parse": round(cpu(lambda: parse_header(view, where="x")), 5),
            },
            "receiver_tag_checks_cpu_s_per_gib": round(cpu(check_all) / gib, 4),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Which blocks of an old rank's snapshot a new rank needs (recovery/ranges.py), on headers
built with the snapshot format: rows of a DTensor's old shard that overlap the new box, whole
entries when there is no box, nothing for an old shard outside it; and ``need`` checked."""

from __future__ import annotations

import pytest

from elasticd.recovery.ranges import needed_blocks, needed_bytes, parse_boxes
from elasticd.snapshot.format import SnapshotHeader, TensorSpec, layout

BLOCK = 4096


def header(old_rows: tuple[int, int]) -> SnapshotHeader:
    """Old rank holding rows [a, b) of a (9, 2048) float32 weight (8 KiB a row, two blocks)
    and of its Adam moment, plus a plain step counter."""
    a, b = old_rows
    specs = [TensorSpec("model/w", "float32", (b - a, 2048)),
             TensorSpec("optim/state/0/exp_avg", "float32", (b - a, 2048)),
             TensorSpec("optim/state/0/step", "float32", ())]
    node = {"@": "dtensor", "shape": [9, 2048], "offsets": [a, 0], "placements": ["S0"],
            "mesh": [3], "dims": []}
    meta = {"objects": [["model", "module", {"w": {**node, "i": 0}}],
                        ["optim", "optimizer", {"exp_avg": {**node, "i": 1}, "step": 2}]]}
    lay = layout(specs, job="j", meta=meta, block_size=BLOCK)
    return SnapshotHeader("j", 1, 0, 1, 3, lay, meta, tuple(range(lay.num_blocks)))


def box(offsets, shape, placements=("S0",)):
    return parse_boxes([[[9, 2048], list(placements), list(offsets), list(shape)]])


def test_only_the_overlapping_rows_of_each_sharded_entry_and_plain_entries_whole():
    h = header((3, 6))  # old rank 1 of 3: rows 3..5
    e = {x.name: x for x in h.layout.entries}
    got = needed_bytes(h, box((0, 0), (5, 2048)))  # new rank 0 of 2: rows 0..4
    row = 8192
    assert got == sorted([
        (e["model/w"].offset, e["model/w"].offset + 2 * row),  # old rows 3, 4
        (e["optim/state/0/exp_avg"].offset, e["optim/state/0/exp_avg"].offset + 2 * row),
        (e["optim/state/0/step"].offset, e["optim/state/0/step"].offset + 4),
    ])
    other = needed_bytes(h, box((5, 0), (4, 2048)))  # new rank 1: rows 5..8: old row 5
    assert (e["model/w"].offset + 2 * row, e["model/w"].offset + 3 * row) in other


def test_blocks_cover_every_needed_byte_and_skip_the_rest():
    h = header((3, 6))
    lay = h.layout
    blocks = needed_blocks(h, box((0, 0), (5, 2048)))
    covered = [lay.block_range(b) for b in blocks]
    for start, end in needed_bytes(h, box((0, 0), (5, 2048))):
        assert all(any(a <= x < b for a, b in covered) for x in (*range(start, end, 64), end - 1))
    assert len(blocks) == lay.num_blocks - 4  # the third row of each tensor is not fetched
    outside = needed_blocks(h, box((6, 0), (3, 2048)))  # rows 6..8: none of this old shard
    step = next(x for x in lay.entries if x.name == "optim/state/0/step")
    assert [lay.block_range(b) for b in outside] == [
        r for r in (lay.block_range(i) for i in range(lay.num_blocks))
        if r[0] <= step.offset < r[1]]


def test_an_entry_without_a_matching_box_is_needed_whole():
    h = header((3, 6))
    whole = [(x.offset, x.offset + x.nbytes) for x in h.layout.entries if x.nbytes]
    assert needed_bytes(h, {}) == sorted(whole)
    # Other placements (a column-sharded tensor of the same shape): not this box.
    assert needed_bytes(h, box((0, 0), (9, 1024), placements=("S1",))) == sorted(whole)
    assert needed_blocks(h, {}) == list(range(h.layout.num_blocks))


def test_junk_offsets_in_a_holders_header_fetch_the_entry_whole():
    """The header comes from a peer (its meta from the job's worker): offsets that are not
    natural numbers are not used, the entry is fetched whole."""
    h = header((3, 6))
    h.meta["objects"][0][2]["w"]["offsets"] = ["3", None]
    e = next(x for x in h.layout.entries if x.name == "model/w")
    assert (e.offset, e.offset + e.nbytes) in needed_bytes(h, box((0, 0), (5, 2048)))


def test_unhashable_junk_in_a_holders_header_fetches_the_entry_whole():
    """A list inside the shape or placements cannot key the boxes: the entry is fetched whole,
    not the whole fetch failed with a TypeError."""
    h = header((3, 6))
    h.meta["objects"][0][2]["w"]["placements"] = [["S0"]]
    h.meta["objects"][1][2]["exp_avg"]["shape"] = [[9], 2048]
    e = {x.name: x for x in h.layout.entries}
    got = needed_bytes(h, box((0, 0), (5, 2048)))
    for name in ("model/w", "optim/state/0/exp_avg"):
        assert (e[name].offset, e[name].offset + e[name].nbytes) in got


@pytest.mark.parametrize("bad", [
    {"w": [[0], [1]]},
    [[[9], ["S0"], [0]]],
    [[[9], ["S0"], [0], [-1]]],
    [[[9], ["S0"], [0, 0], [3]]],
    [[[9], [0], [0], [3]]],
    [[[9], ["S0"], [0], [3]], [[9], ["S0"], [3], [3]]],
])
def test_a_malformed_need_is_refused_with_what_is_wrong(bad):
    with pytest.raises(ValueError, match="need"):
        parse_boxes(bad)


def test_at_the_default_block_size_a_reshard_fetches_little_more_than_its_rows():
    """bench_sharded_restore.py's geometry: 13 Linear weights and their two Adam moments,
    2827 or 2831 rows row-sharded at world 3, of which new rank 0 of 2 needs the first half.
    Of old rank 1's shard (rows 944..1887) it needs rows up to 1415: a part of each entry, so
    the blocks around each part's two ends are fetched whole. At 4 MiB blocks that was 1.70x
    the bytes needed (727 MB a new rank where its shards hold 577 MB); at the default now,
    1.18x."""
    dims = [2827, 2831] * 6 + [2827]
    specs, nodes = [], {}
    for n, (cols, rows) in enumerate(zip(dims, dims[1:])):
        per = -(-rows // 3)
        for kind in ("w", "exp_avg", "exp_avg_sq"):
            nodes[f"{kind}{n}"] = {"@": "dtensor", "shape": [rows, cols], "offsets": [per, 0],
                                   "placements": ["S0"], "mesh": [3], "dims": [],
                                   "i": len(specs)}
            specs.append(TensorSpec(f"{kind}{n}", "float32", (min(rows, 2 * per) - per, cols)))
    meta = {"objects": [["model", "module", nodes]]}
    lay = layout(specs, job="j", meta=meta)  # the default block size
    h = SnapshotHeader("j", 1, 0, 1, 3, lay, meta, tuple(range(lay.num_blocks)))
    boxes = parse_boxes([[[rows, cols], ["S0"], [0, 0], [-(-rows // 2), cols]]
                         for cols, rows in {(c, r) for c, r in zip(dims, dims[1:])}])
    needed = sum(end - start for start, end in needed_bytes(h, boxes))
    fetched = sum(lay.block_range(b)[1] - lay.block_range(b)[0] for b in needed_blocks(h, boxes))
    assert needed <= fetched <= 1.25 * needed, fetched / needed


def test_a_snapshot_keeps_the_block_size_it_was_made_with():
    """A snapshot (or replica) made at another block size than today's default is read and
    fetched by its own: the header says it, and the blocks a reshard asks for are that
    header's (what a change of the default must keep: restore31 tried 512 KiB)."""
    from elasticd.snapshot.format import DEFAULT_BLOCK_SIZE, encode_header
    from elasticd.snapshot.reader import parse_header

    specs = [TensorSpec("model/w", "float32", (300, 2048))]
    node = {"@": "dtensor", "shape": [900, 2048], "offsets": [300, 0], "placements": ["S0"],
            "mesh": [3], "dims": [], "i": 0}
    meta = {"objects": [["model", "module", {"w": node}]]}
    other = 512 << 10 if DEFAULT_BLOCK_SIZE != 512 << 10 else 1 << 20
    old = layout(specs, job="j", meta=meta, block_size=other)
    raw = encode_header(SnapshotHeader("j", 1, 0, 1, 3, old, meta, (0,) * old.num_blocks))
    h = parse_header(raw + bytes(old.total_size - len(raw)))
    assert h.layout.block_size == other and h.layout.num_blocks == old.num_blocks
    # rows 300..449 of the 900: the payload's first 1.2 MB (150 rows of 8 KiB), whole blocks
    need = parse_boxes([[[900, 2048], ["S0"], [0, 0], [450, 2048]]])
    assert needed_blocks(h, need) == list(range(-(-150 * 8192 // other)))

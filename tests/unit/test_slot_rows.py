"""A reshard's rows read from the slot file (``preadv``) instead of through its mapping
(elasticd/worker/slot_rows.py): the same bytes, and the mapping's pages never faulted in; on
huge pages copied out of the mapping with one ``memmove`` a piece instead."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import resource
import shutil
import subprocess
import tempfile
import uuid
import warnings

import numpy as np
import pytest
import torch

from elasticd.store.shm import SlotStore
from elasticd.testing.transport import InProcessTransport
from elasticd.worker.shards import Resharder
from elasticd.worker.scratch_maps import ScratchMaps
from elasticd.worker.slot_rows import SlotFiles, mapping_address
from tests.unit.test_store_peer_restore import nodes  # noqa: F401 — the fixture
from tests.unit.test_store_service import write_snapshot

ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None  # a slot store's tmpfs


@pytest.fixture
def slot():
    """A read-only mapping of a file holding a float32 tensor of 1024 x 4096 (16 MiB) at
    offset 4096, its descriptor, and that tensor's values."""
    values = torch.arange(1024 * 4096, dtype=torch.float32).view(1024, 4096)
    fd, path = tempfile.mkstemp(dir=ROOT)
    try:
        os.pwrite(fd, values.numpy().tobytes(), 4096)
        mm = mmap.mmap(fd, 4096 + values.numel() * 4, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: a read-only buffer
            whole = torch.frombuffer(mm, dtype=torch.uint8)
        view = whole[4096:].view(torch.float32).view(1024, 4096)
        yield mm, fd, view, values
        del whole, view
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_rows_of_a_mapped_slot_are_read_from_its_file_without_faulting_it_in(slot, copies):
    mm, fd, view, values = slot
    files = SlotFiles([(mapping_address(mm), fd, 0)])
    # New rank's box: rows 300..1000 of the tensor; the mapped piece holds rows 200..1224.
    target = ((300, 0), (700, 4096))
    into = torch.zeros(700, 4096)
    before = _faults()
    got = Resharder._assemble("w", target, [(((200, 0), (1024, 4096)), view)], torch.float32,
                              into=into, files=files)
    faults = _faults() - before
    assert got is into and torch.equal(into, values[100:800])
    assert copies == {"memmove": [], "preadv": 1}  # one call: whole rows, one run of bytes
    # Through the mapping: one fault per 4 KiB page or per fault-around window (64 KiB),
    # 175 to 2800 for these 11 MiB (179 measured).
    assert faults < 64, faults


def test_a_row_copy_is_located_before_it_is_made_where_it_reads_and_writes(slot, copies):
    """``locate`` names the copy ``read`` would make (a plan can record it instead: the
    worker that fetches its own rows, bench/spikes/worker_fetch.py), and makes none."""
    mm, fd, view, values = slot
    files = SlotFiles([(mapping_address(mm), fd, 0)])
    into = torch.zeros(700, 4096)
    src = (slice(100, 800), slice(0, 4096))
    dst = (slice(0, 700), slice(0, 4096))
    copy = files.locate(into, dst, view, src)
    assert copy is not None and copies == {"memmove": [], "preadv": 0}
    row = 4096 * 4
    assert (copy.mapping, copy.fd, copy.huge) == (mapping_address(mm), fd, 0)
    assert (copy.at, copy.into, copy.nbytes) == (4096 + 100 * row, into.data_ptr(), 700 * row)
    assert not into.any()  # nothing copied
    assert files.locate(torch.zeros(1024, 100), (slice(0, 1024), slice(0, 100)), view,
                        (slice(0, 1024), slice(0, 100))) is None  # columns: not one run


def test_pieces_that_are_not_whole_rows_of_a_file_go_through_the_mapping(slot, copies):
    mm, fd, view, values = slot
    files = SlotFiles([(mapping_address(mm), fd, 0)])
    # Columns (Shard(1)): not one run of bytes.
    cols = torch.zeros(1024, 100)
    Resharder._assemble("w", ((0, 50), (1024, 100)), [(((0, 0), (1024, 4096)), view)],
                        torch.float32, into=cols, files=files)
    assert torch.equal(cols, values[:, 50:150]) and copies["preadv"] == 0
    # A tensor that is no view of a slot given here (this rank's own copy).
    own = values.clone()
    rows = torch.zeros(10, 4096)
    Resharder._assemble("w", ((5, 0), (10, 4096)), [(((0, 0), (1024, 4096)), own)],
                        torch.float32, into=rows, files=files)
    assert torch.equal(rows, values[5:15]) and copies["preadv"] == 0


def test_one_dimensional_and_two_byte_rows_land_where_they_belong(slot, copies):
    mm, fd, view, values = slot
    files = SlotFiles([(mapping_address(mm), fd, 0)])
    flat = view.reshape(-1)[:1000]  # a bias-like 1-D entry at the piece's start
    out = torch.full((400,), -1.0)
    got = Resharder._assemble("b", ((250,), (400,)), [(((100,), (300,)), flat[:300]),
                                                      (((400,), (600,)), flat[300:900])],
                              torch.float32, into=out, files=files)
    assert got is out and torch.equal(out, values.reshape(-1)[150:550])
    assert copies["preadv"] == 2  # one per piece
    halves = view.view(torch.bfloat16)[:8]  # 8 rows of 8192 bfloat16
    into = torch.zeros(3, 8192, dtype=torch.bfloat16)
    Resharder._assemble("h", ((2, 0), (3, 8192)), [(((0, 0), (8, 8192)), halves)],
                        torch.bfloat16, into=into, files=files)
    assert torch.equal(into.view(torch.uint8), halves[2:5].contiguous().view(torch.uint8))


def test_a_piece_fetched_in_place_hands_its_slot_file_to_the_resharder_until_released(nodes):
    """``Sources`` keeps a descriptor of each slot read in place (the file the daemon handed
    over, never a path) for the resharder's reads, and closes it at the release."""
    from elasticd.worker.sources import Sources

    _, t, _, t2 = nodes
    _, data = write_snapshot(t2, "job", 2, step=4, world=3)
    sources = Sources(t, "job", 0, 2)
    sources.scratch_maps = ScratchMaps()
    sources.boxes = [[[3000], ["S0"], [0], [1500]]]
    got = sources._from_daemon("ckpt_fetch", (0, 4), 3, [], 2, in_place=True)
    assert got is not None and got.slot_file is not None
    address, fd, huge = got.slot_file
    assert huge >= len(data) * 4  # restore scratch: copied out of the kept mapping
    files = got.slot_files()
    w = got.tensors[got.names.index("w")]
    assert w.untyped_storage().data_ptr() == address
    out = torch.zeros(len(data) // 2, dtype=w.dtype)
    assert files.read(out, (slice(0, len(out)),), w, (slice(0, len(out)),))
    assert np.array_equal(out.numpy(), data[: len(out)])
    os.fstat(fd)  # open until the release
    got.close()
    assert got.slot_file is None
    with pytest.raises(OSError):
        os.fstat(fd)
    sources.scratch_maps.close()


def test_restore_scratch_is_read_through_the_mapping_kept_from_the_last_restore(nodes, copies):
    """The next restore of the same old rank lands in the scratch the last one released (the
    daemon keeps it, pages touched): the worker copies its rows out of the mapping it kept,
    whose pages are mapped already (0.097 CPU s per GiB against ``preadv``'s 0.228,
    bench/results/restore36/), and reads the new copy's bytes there, not the old ones."""
    from elasticd.worker.sources import Sources

    _, t, _, t2 = nodes
    maps = ScratchMaps()
    n = 1 << 20  # 4 MiB of float32: 64 fault-arounds of 64 KiB through a fresh mapping
    try:
        seen = []
        for step in (4, 5):
            _, data = write_snapshot(t2, "job", 2, step=step, world=3, n=n)
            sources = Sources(t, "job", 0, 2)
            sources.scratch_maps = maps
            sources.boxes = [[[2 * n], ["S0"], [0], [n]]]
            got = sources._from_daemon("ckpt_fetch", (0, step), 3, [], 2, in_place=True)
            assert got is not None and got.slot_file is not None
            w = got.tensors[got.names.index("w")]
            out = torch.zeros(n, dtype=w.dtype)
            faults = _faults()
            assert got.slot_files().read(out, (slice(0, n),), w, (slice(0, n),))
            seen.append((got.slot_file[0], _faults() - faults))
            assert np.array_equal(out.numpy(), data)  # this step's bytes
            del w
            got.close()
        assert len(maps._maps) == 1 and seen[0][0] == seen[1][0]  # the same file, the same mapping
        assert (maps.made, maps.reused) == (1, 1)  # counted, for the bench
        assert seen[0][1] >= 32 and seen[1][1] < 8  # its pages mapped already the second time
        assert copies == {"memmove": [4 * n, 4 * n], "preadv": 0}
    finally:
        maps.close()


def test_kept_scratch_mappings_are_bounded_and_a_file_unlinked_is_unmapped(tmp_path):
    maps = ScratchMaps()
    maps.keep = 2  # (KEEP is 8)
    fds = []
    try:
        for i in range(3):
            path = os.path.join(ROOT or str(tmp_path), f"elasticd-test-{uuid.uuid4().hex[:8]}")
            fds.append((os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), path))
            os.ftruncate(fds[-1][0], 8192)
        first = maps.map(fds[0][0], 4096)
        assert maps.map(fds[0][0], 8192) is first and len(first) == 8192  # the whole file
        with pytest.raises(ValueError):
            maps.map(fds[1][0], 16384)  # more than the file holds
        maps.map(fds[1][0], 4096)
        maps.map(fds[2][0], 4096)
        assert len(maps._maps) == 2 and first.closed  # the least recent one went
        os.unlink(fds[1][1])
        maps.map(fds[2][0], 4096)
        assert len(maps._maps) == 1  # unlinked without being emptied: not kept
    finally:
        maps.close()
        for fd, path in fds:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@pytest.fixture
def copies(monkeypatch):
    """Counts the ``memmove`` calls (the bytes of each) and the ``preadv`` calls."""
    seen = {"memmove": [], "preadv": 0}
    memmove, preadv = ctypes.memmove, os.preadv

    def counted_memmove(dst, src, n):
        seen["memmove"].append(n)
        return memmove(dst, src, n)

    def counted_preadv(*args):
        seen["preadv"] += 1
        return preadv(*args)

    monkeypatch.setattr(ctypes, "memmove", counted_memmove)
    monkeypatch.setattr(os, "preadv", counted_preadv)
    return seen


def test_rows_of_a_slot_on_huge_pages_are_copied_out_of_its_mapping_in_one_memmove(slot, copies):
    mm, fd, view, values = slot
    files = SlotFiles([(mapping_address(mm), fd, len(mm))])  # as for a file on huge pages
    into = torch.zeros(700, 4096)
    got = Resharder._assemble("w", ((300, 0), (700, 4096)), [(((200, 0), (1024, 4096)), view)],
                              torch.float32, into=into, files=files)
    assert got is into and torch.equal(into, values[100:800])
    assert copies == {"memmove": [700 * 4096 * 4], "preadv": 0}


def test_a_box_outside_the_tensor_or_the_mapping_is_not_copied_by_address(slot, copies):
    mm, fd, view, values = slot
    out = torch.zeros(30, 4096)
    rows = (slice(0, 30), slice(0, 4096))
    for huge in (0, len(mm)):  # rows past the tensor's end: torch's indexing refuses them
        assert not SlotFiles([(mapping_address(mm), fd, huge)]).read(
            out, rows, view, (slice(1000, 1030), slice(0, 4096)))
    # A mapping shorter than the rows asked for: not this slot's bytes.
    short = SlotFiles([(mapping_address(mm), fd, 4096 + 10 * 4096 * 4)])
    assert not short.read(out, rows, view, rows)
    assert short.read(out[:10], (slice(0, 10), slice(0, 4096)), view,
                      (slice(0, 10), slice(0, 4096)))
    assert torch.equal(out[:10], values[:10]) and not out[10:].any()
    assert copies == {"memmove": [10 * 4096 * 4], "preadv": 0}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_slot_on_a_huge_page_tmpfs_read_in_place_is_copied_out_of_its_mapping(tmp_path,
                                                                                copies):
    """A node's own slot on a huge-page mount, read in place for a reshard (``ckpt_fetch`` of
    a rank it holds: no copy, the slot itself): the resharder copies its rows with
    ``memmove``, not ``preadv`` (2.1x the CPU there, bench/results/restore35/)."""
    from elasticd.store.service import CheckpointService
    from elasticd.worker.sources import Sources

    point = str(tmp_path / "huge")
    os.mkdir(point, 0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,huge=within_size,mode=0700",
                    "tmpfs", point], check=True)
    try:
        store = SlotStore(os.path.join(point, f"slots-{uuid.uuid4().hex[:8]}"))
        try:
            t = InProcessTransport(CheckpointService(store, "n1").handlers())
            _, data = write_snapshot(t, "job", 2, step=4, world=3, n=1 << 20)  # 4 MiB: huge
            sources = Sources(t, "job", 0, 2)
            sources.fetchable = {(0, 4)}
            got = sources._from_daemon("ckpt_fetch", (0, 4), 3, [], 2, in_place=True)
            assert got is not None and got.slot_file is not None
            w = got.tensors[got.names.index("w")]
            out = torch.zeros(len(data) // 2, dtype=w.dtype)
            assert got.slot_files().read(out, (slice(0, len(out)),), w, (slice(0, len(out)),))
            assert np.array_equal(out.numpy(), data[: len(out)])
            assert copies == {"memmove": [out.nbytes], "preadv": 0}
            del w  # the last view: the release unmaps the slot
            got.close()
        finally:
            store.close()
    finally:
        # Lazily: the service may still hold the handed slot's descriptor under its pin.
        subprocess.run(["umount", "--lazy", point], check=True)
        shutil.rmtree(point, ignore_errors=True)

"""Spike (issue 30, restore35): what the worker's one copy out of restore scratch costs, per
way of doing it, in CPU seconds per GiB, alone on the machine (run under the CPU lock).

The restore's worker copies the rows its new shards need out of the scratch segment the daemon
fetched into (a tmpfs file, handed over as a descriptor) into the live state's tensors, which
are memory already touched (``elasticd/worker/slot_rows.py``: ``preadv``). restore32's perf
put that copy at 274 CPU ms a restore over both workers (219 kernel copy + 55 kernel page
work). Measured here, each way on the same bytes, interleaved, min and median of ``--reps``:

* ``memcpy``: two touched anonymous buffers, numpy ``copyto`` (what a copy costs at all);
* ``preadv``: from the file, row pieces of ``--piece`` bytes (today's path); ``preadv_256k``
  the same in 256 KiB calls (whether a copy that stays in cache-sized calls is cheaper);
* ``mmap_populate``: map the file (MAP_POPULATE), ``copyto`` from the mapping, unmap;
* ``mmap_fault``: map without populate (fault-around), ``copyto``, unmap;
* ``map_memmove_8m`` / ``_1m``: the same mapping, one ``ctypes.memmove`` per 8 MiB / 1 MiB
  (a shard's row pieces are MiBs: glibc copies below its non-temporal threshold, 240 MiB
  here, with ordinary stores); ``map_torch_8m``: torch ``copy_`` per 8 MiB (restore31's
  "through the mapping"); ``memcpy_8m``: two touched buffers, per 8 MiB;
* each from a scratch file of small pages (``/dev/shm``, what ``ScratchSpace.new`` makes on
  every mount) and, with ``--huge DIR`` (a tmpfs mounted ``huge=within_size``), from a file of
  huge pages.

    cpulock python bench/spikes/worker_copy.py --mib 576 --reps 5 [--huge /mnt/hugetmp]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import time
import warnings

import numpy as np


def cpu() -> float:
    return time.process_time()


def make_file(directory: str, nbytes: int, small: bool) -> tuple[str, int]:
    path = os.path.join(directory, f"spike-worker-copy-{os.getpid()}-{int(small)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    if small:
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    np.frombuffer(mm, dtype=np.uint8)[:] = np.random.default_rng(0).integers(
        0, 255, size=nbytes, dtype=np.uint8)
    mm.close()
    return path, fd


def way_memcpy(src: np.ndarray, dst: np.ndarray, fd: int, piece: int) -> None:
    np.copyto(dst, src)


def way_preadv(src: np.ndarray, dst: np.ndarray, fd: int, piece: int) -> None:
    view = memoryview(dst)
    at = 0
    while at < len(view):
        n = os.preadv(fd, [view[at : at + piece]], at)
        at += n


def way_preadv_256k(src: np.ndarray, dst: np.ndarray, fd: int, piece: int) -> None:
    way_preadv(src, dst, fd, 256 << 10)


def _mapped(fd: int, dst: np.ndarray, populate: bool) -> None:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    mm = mmap.mmap(fd, len(dst), flags=flags, prot=mmap.PROT_READ)
    src = np.frombuffer(mm, dtype=np.uint8)
    np.copyto(dst, src)
    del src
    mm.close()


def _mapped_pieces(fd: int, dst: np.ndarray, piece: int, how: str) -> None:
    """Through a mapping (faulted around, as the worker's in-place mapping is), one copy per
    ``piece`` bytes: ``memmove`` (glibc's, what ``ctypes.memmove`` and numpy call) or
    torch's ``copy_`` (what ``out[dst] = t[src]`` does)."""
    mm = mmap.mmap(fd, len(dst), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    src = np.frombuffer(mm, dtype=np.uint8)
    if how == "memmove":
        s0, d0 = src.ctypes.data, dst.ctypes.data
        for at in range(0, len(dst), piece):
            ctypes.memmove(d0 + at, s0 + at, min(piece, len(dst) - at))
    else:
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ts, td = torch.frombuffer(src, dtype=torch.uint8), torch.from_numpy(dst)
            for at in range(0, len(dst), piece):
                td[at : at + piece].copy_(ts[at : at + piece])
            del ts, td
    del src
    mm.close()


def way_memmove_8m(src: np.ndarray, dst: np.ndarray, fd: int, piece: int) -> None:
    _mapped_pieces(fd, dst, 8 << 20, "memmove")


def way_memmove_1m(src: np.ndarray, dst: np.ndarray, fd: int, piece: int) -> None:
    _mapped_pieces(fd, dst, 1 << 20, "memmove")


def way_torch_8m(src: np.ndarray, dst: np.ndarray, fd: int, piece: int) -> None:
    _mapped_pieces(fd, dst, 8 << 20, "torch")


def way_memcpy_8m(src: np.ndarray, dst: np.ndarray, fd: int, piece: int) -> None:
    s0, d0 = src.ctypes.data, dst.ctypes.data
    for at in range(0, len(dst), 8 << 20):
        ctypes.memmove(d0 + at, s0 + at, min(8 << 20, len(dst) - at))


def way_mmap_populate(src: np.ndarray, dst: np.ndarray, fd: int, piece: int) -> None:
    _mapped(fd, dst, True)


def way_mmap_fault(src: np.ndarray, dst: np.ndarray, fd: int, piece: int) -> None:
    _mapped(fd, dst, False)


WAYS = {"preadv": way_preadv, "preadv_256k": way_preadv_256k,
        "mmap_populate": way_mmap_populate,
        "mmap_fault": way_mmap_fault, "map_memmove_8m": way_memmove_8m,
        "map_memmove_1m": way_memmove_1m, "map_torch_8m": way_torch_8m}
ANON = {"memcpy": way_memcpy, "memcpy_8m": way_memcpy_8m}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=576)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--piece", type=int, default=8 << 20)
    parser.add_argument("--huge", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    nbytes = args.mib << 20
    src = np.ones(nbytes, dtype=np.uint8)  # touched
    dst = np.zeros(nbytes, dtype=np.uint8)  # touched, like the live state's tensors
    files = {"small": make_file("/dev/shm", nbytes, True)}
    if args.huge:
        files["huge"] = make_file(args.huge, nbytes, False)
    samples: dict[str, list[float]] = {}
    try:
        for _ in range(args.reps):
            ways = [(name, way, "") for name, way in ANON.items()] + [
                (f"{name}/{pages}", way, pages) for pages in files for name, way in WAYS.items()]
            for name, way, pages in ways:
                dst[:] = 0
                t0 = cpu()
                way(src, dst, files[pages][1] if pages else -1, args.piece)
                samples.setdefault(name, []).append(cpu() - t0)
                assert dst[:4096].any() and dst[-4096:].any(), name
    finally:
        for path, fd in files.values():
            os.close(fd)
            os.unlink(path)
    gib = nbytes / (1 << 30)
    out = {"command": "python bench/spikes/worker_copy.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v not in ("", None)),
        "bytes": nbytes, "cpu_seconds_per_gib": {
            k: {"min": round(min(v) / gib, 4), "median": round(statistics.median(v) / gib, 4),
                "runs": [round(x / gib, 4) for x in v]} for k, v in samples.items()}}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

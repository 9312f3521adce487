"""Spike (issue 30, restore36): the worker's copy out of restore scratch through a mapping it
keeps from one restore to the next, against today's ``preadv``, CPU seconds per GiB.

Restore scratch is kept for the job's next restore with its pages touched
(``store/scratch_pool.py``), and the next copy of the same old rank lands in the same pages. A
worker that keeps its read-only mapping of that file from the last restore has the page-table
entries already: the copy out of it is a copy between two touched buffers (restore35: 0.097
CPU s per GiB on small pages, against ``preadv``'s 0.245). Measured here, interleaved, medians
of ``--reps``, on the same bytes, before each rep the file rewritten through another mapping
(the daemon landing the next restore's blocks; the pages stay the same ones):

* ``preadv``: one call per ``--piece`` bytes (today's path on small pages);
* ``fresh_map``: map, ``memmove`` per piece, unmap (a mapping per restore);
* ``kept_map``: one mapping made at the first rep and kept, ``memmove`` per piece (the first
  rep faults its pages in; later reps find them mapped);
* on a ``/dev/shm`` file of small pages and, with ``--huge DIR``, on a huge-page tmpfs.

    cpulock python bench/spikes/kept_mapping.py --mib 576 --reps 7 [--huge DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time

import numpy as np
from worker_copy import make_file  # the spike beside this one


def writable(directory: str, nbytes: int, small: bool) -> tuple[str, int, mmap.mmap]:
    """A file of ``nbytes`` written in pages of the kind asked for (worker_copy's), its
    descriptor and a mapping to write it through (the daemon's)."""
    path, fd = make_file(directory, nbytes, small)
    return path, fd, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)


def copy_pieces(src: int, dst: int, nbytes: int, piece: int) -> None:
    for at in range(0, nbytes, piece):
        ctypes.memmove(dst + at, src + at, min(piece, nbytes - at))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, kind, default in (("--mib", int, 576), ("--reps", int, 7), ("--piece", int, 8 << 20),
                                ("--huge", str, ""), ("--out", str, "")):
        parser.add_argument(flag, type=kind, default=default)
    args = parser.parse_args()
    nbytes = args.mib << 20
    dst = np.zeros(nbytes, dtype=np.uint8)  # touched, like the live state's tensors
    d0 = dst.ctypes.data
    files = {"small": writable("/dev/shm", nbytes, True)}
    if args.huge:
        files["huge"] = writable(args.huge, nbytes, False)
    kept = {pages: mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            for pages, (_, fd, _) in files.items()}
    samples: dict[str, list[float]] = {}
    try:
        for rep in range(args.reps):
            for pages, (_, fd, writer) in files.items():
                for way in ("preadv", "fresh_map", "kept_map"):
                    value = (rep * 3 + len(way)) % 250 + 2
                    np.frombuffer(writer, dtype=np.uint8)[::4096] = value  # the daemon's write
                    dst[:] = 0
                    t0 = time.process_time()
                    if way == "preadv":
                        view = memoryview(dst)
                        at = 0
                        while at < nbytes:
                            at += os.preadv(fd, [view[at : at + args.piece]], at)
                    elif way == "fresh_map":
                        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                        src = np.frombuffer(mm, dtype=np.uint8)
                        copy_pieces(src.ctypes.data, d0, nbytes, args.piece)
                        del src
                        mm.close()
                    else:
                        src = np.frombuffer(kept[pages], dtype=np.uint8)
                        copy_pieces(src.ctypes.data, d0, nbytes, args.piece)
                        del src
                    samples.setdefault(f"{way}/{pages}", []).append(time.process_time() - t0)
                    assert dst[0] == value and dst[-4096] == value, (way, pages)
    finally:
        for m in kept.values():
            m.close()
        for path, fd, writer in files.values():
            writer.close()
            os.close(fd)
            os.unlink(path)
    per_gib = {k: [round(x * (1 << 30) / nbytes, 4) for x in v] for k, v in samples.items()}
    text = json.dumps({
        "command": "python bench/spikes/kept_mapping.py " + " ".join(sys.argv[1:]),
        "bytes": nbytes, "cpu_seconds_per_gib": {
            k: {"first": v[0], "median_after_first": statistics.median(v[1:]), "runs": v}
            for k, v in per_gib.items()}}, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

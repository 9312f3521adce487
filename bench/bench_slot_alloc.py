"""What a fresh slot costs before the first byte is copied into it, on /dev/shm's 4 KiB pages
and on a tmpfs mounted with ``huge=within_size`` (what ``systemd/run-elasticd-shm.mount``
gives), beside memcpy of the same bytes into memory already mapped (the baseline), same run.

Per round and per file system (the huge-page tmpfs twice: right after the 4 KiB round freed
its memory, and back to back), for a slot of ``--mib``: ``Segment.allocate`` as the daemon runs
it (``fallocate`` + one ``MADV_POPULATE_WRITE``), split into its two parts, the older pre-fault
(a write per page from numpy) for comparison, and the first copy into the pre-faulted slot.
Needs root (it mounts the tmpfs, and unmounts it). Run under the CPU lock::

    flock /tmp/elasticd-cpu.lock python bench/bench_slot_alloc.py --mib 385 --repeat 5 \\
        --out bench/results/slot_alloc.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from elasticd.snapshot.segment import MADV_POPULATE_WRITE, PAGE, Segment
from elasticd.store.huge_pages import probe


def one(root: str, size: int, src: np.ndarray) -> dict[str, float]:
    """Times one slot's life in ``root``: the product's allocate, then its parts separately."""
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    out: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        seg = Segment.allocate(dir_fd, "slot", os.path.join(root, "slot"), size)
        out["allocate (fallocate + populate)"] = time.perf_counter() - t0
        dst = np.frombuffer(seg.view, dtype=np.uint8)
        t0 = time.perf_counter()
        dst[:] = src
        out["first copy into the slot"] = time.perf_counter() - t0
        del dst
        seg.destroy(dir_fd)
        for populate in ("madvise", "write per page"):
            fd = os.open("part", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            try:
                t0 = time.perf_counter()
                os.posix_fallocate(fd, 0, size)
                t1 = time.perf_counter()
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                if populate == "madvise":
                    mm.madvise(MADV_POPULATE_WRITE)
                else:
                    np.frombuffer(mm, dtype=np.uint8)[::PAGE] = 0
                t2 = time.perf_counter()
                mm.close()
            finally:
                os.close(fd)
                os.unlink("part", dir_fd=dir_fd)
            out["fallocate"] = t1 - t0
            out[f"pre-fault: {populate}"] = t2 - t1
    finally:
        os.close(dir_fd)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=385)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    size = args.mib << 20
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    warm = np.empty_like(src)
    warm[:] = 0
    work = tempfile.mkdtemp(prefix="elasticd-bench-alloc-", dir="/tmp")
    point = os.path.join(work, "huge")
    os.mkdir(point, 0o700)
    small = tempfile.mkdtemp(prefix="elasticd-bench-alloc-", dir="/dev/shm")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=within_size,size={2 * args.mib + 64}m",
                    "elasticd-bench-alloc", point], check=True)
    rows: dict[str, dict[str, list[float]]] = {}
    memcpy: list[float] = []
    try:
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            warm[:] = src
            memcpy.append(time.perf_counter() - t0)
            # The huge-page slot twice: right after the 4 KiB round freed its pages (the
            # allocator first merges them into 2 MiB blocks), then again (huge pages freed by
            # the previous slot): a node's memory lies between the two.
            for root, when in ((small, ""), (point, ", right after 4 KiB pages were freed"),
                               (point, ", back to back")):
                label = probe(root).describe() + when
                for key, value in one(root, size, src).items():
                    rows.setdefault(label, {}).setdefault(key, []).append(value)
    finally:
        subprocess.run(["umount", point], check=True)
        os.rmdir(point)
        os.rmdir(work)
        os.rmdir(small)
    med = {label: {k: round(statistics.median(v), 4) for k, v in parts.items()}
           for label, parts in rows.items()}
    small_label, churned_label, huge_label = list(med)
    key = "allocate (fallocate + populate)"
    summary = {
        "benchmark": "slot_alloc",
        "command": " ".join(["bench/bench_slot_alloc.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "slot_mib": args.mib,
        "repeat": args.repeat,
        "baseline: memcpy into mapped memory, seconds": round(statistics.median(memcpy), 4),
        "median_seconds": med,
        "runs": {label: {k: [round(x, 4) for x in v] for k, v in parts.items()}
                 for label, parts in rows.items()},
        "allocate_small_over_huge": round(med[small_label][key] / med[huge_label][key], 2),
        "allocate_small_over_huge_after_4k_churn": round(
            med[small_label][key] / med[churned_label][key], 2),
        "allocate_small_over_memcpy": round(med[small_label][key] / statistics.median(memcpy), 2),
        "allocate_huge_over_memcpy": round(med[huge_label][key] / statistics.median(memcpy), 2),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

"""What a fresh scratch segment costs to reserve: huge pages against small, first touch against
reuse, beside a write of the same bytes into memory touched beforehand.

A restore at another world size fetches peers' shards into scratch segments reserved at that
moment (``Segment.reserve_range``: ``fallocate`` plus one ``MADV_POPULATE_WRITE``). On a VM whose
kernel reports free memory to its host (virtio-balloon free page reporting:
``page_reporting.page_reporting_order`` on the kernel command line), a freed block of that order
goes back to the host a few seconds after it is freed, and the next touch of it faults on the host
side. Huge pages are taken from exactly such blocks; small pages mostly from lower orders that
are never reported. This bench shows what that costs, per round:

* ``fallocate`` and populate of ``--mib`` MiB in a fresh file, then the file removed;
* three rounds back to back (the freed blocks not yet reported), then one after ``--idle``
  seconds (reported by then, where the kernel reports);
* on a huge-page tmpfs and a small-page one (mounted by the bench in a temporary directory, so
  it runs as root, and unmounted after);
* baseline: ``memset`` of the same bytes into memory written beforehand, in the same run.

Run as root, alone (``flock /tmp/elasticd-cpu.lock``)::

    python bench/bench_first_touch.py --mib 385 --json bench/results/first_touch.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time

MADV_POPULATE_WRITE = 23  # Linux 5.14; the same advice Segment.reserve_range gives


def reserve(directory: str, nbytes: int) -> tuple[float, float]:
    """(fallocate seconds, populate seconds) of a fresh ``nbytes`` file in ``directory``."""
    path = os.path.join(directory, "scratch")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        start = time.perf_counter()
        os.posix_fallocate(fd, 0, nbytes)
        allocated = time.perf_counter()
        with mmap.mmap(fd, nbytes) as mm:
            mm.madvise(MADV_POPULATE_WRITE, 0, nbytes)
            populated = time.perf_counter()
        return allocated - start, populated - allocated
    finally:
        os.close(fd)
        os.unlink(path)


def memset_baseline(nbytes: int) -> float:
    buf = bytearray(nbytes)
    buf[::4096] = b"\1" * len(range(0, nbytes, 4096))  # touched beforehand
    address = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(buf))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        ctypes.memset(address, 7, nbytes)
        best = min(best, time.perf_counter() - start)
    return best


def page_reporting_order() -> str | None:
    with open("/proc/cmdline") as f:
        for word in f.read().split():
            if word.startswith("page_reporting.page_reporting_order="):
                return word.split("=", 1)[1]
    return None


def run(args: argparse.Namespace) -> dict:
    nbytes = args.mib << 20
    out: dict = {"mib": args.mib, "idle_seconds": args.idle, "kernel": os.uname().release,
                 "page_reporting_order": page_reporting_order(),
                 "memset_seconds": memset_baseline(nbytes), "mounts": {}}
    root = tempfile.mkdtemp(prefix="elasticd-first-touch-")
    try:
        for name, options in (("huge", f"huge=within_size,size={2 * args.mib}m"),
                              ("small", f"size={2 * args.mib}m")):
            where = os.path.join(root, name)
            os.mkdir(where)
            subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", where], check=True)
            try:
                rounds = []
                for i in range(4):
                    if i == 3:
                        time.sleep(args.idle)
                    fa, pop = reserve(where, nbytes)
                    rounds.append({"after_idle": i == 3, "fallocate_seconds": round(fa, 4),
                                   "populate_seconds": round(pop, 4),
                                   "total_seconds": round(fa + pop, 4)})
                out["mounts"][name] = rounds
            finally:
                subprocess.run(["umount", where], check=True)
    finally:
        for name in ("huge", "small"):
            path = os.path.join(root, name)
            if os.path.isdir(path):
                os.rmdir(path)
        os.rmdir(root)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=385)
    parser.add_argument("--idle", type=float, default=10.0,
                        help="seconds before the last round (free page reporting's delay is 2 s)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_first_touch: run as root (it mounts two tmpfs)")
    out = run(args)
    gbps = (args.mib << 20) / out["memset_seconds"] / 1e9
    print(f"{args.mib} MiB; kernel {out['kernel']}; page_reporting_order "
          f"{out['page_reporting_order']}; memset into touched memory "
          f"{out['memset_seconds']:.3f} s ({gbps:.1f} GB/s)")
    for name, rounds in out["mounts"].items():
        cells = " ".join(f"{r['total_seconds']:.3f}" + ("(idle)" if r["after_idle"] else "")
                         for r in rounds)
        print(f"{name:6} reserve + populate per round, s: {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Snapshot stall: elasticd's copy into shared memory against memcpy and torch.save.

Builds a state of ``--size-mib`` MiB held in ``--tensors`` tensors of log-normally spread sizes
(float32, with some bfloat16, like a real model plus optimizer state), then prints the median of
``--repeat`` runs of:

* ``memcpy``: numpy ``copyto`` of the same number of bytes, one contiguous array into another,
  pre-touched (the ceiling);
* ``elasticd stall``: what the training loop waits for: :func:`~elasticd.worker.state.flatten`,
  the layout, :meth:`~elasticd.store.shm.SlotStore.reserve` and
  :func:`~elasticd.worker.copier.copy_into` into the store's pre-touched slot;
* ``elasticd seal``: the daemon-side rest: xxh3 block checksums and the header
  (:meth:`~elasticd.store.shm.SlotStore.complete`), off the training loop's path;
* ``torch.save+fsync``: ``torch.save`` of the same tensors to ``--disk-dir``, flushed and fsynced.

The store's slots are allocated (and pre-touched) by a warm-up snapshot that is not timed, as a
daemon would do at the first snapshot. Run under ``flock /tmp/elasticd-cpu.lock`` on shared
machines::

    python bench/bench_snapshot.py --size-mib 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid

import numpy as np
import torch

from elasticd.worker.copier import copy_into
from elasticd.snapshot.format import SnapshotHeader
from elasticd.store.shm import SlotStore
from elasticd.worker.state import flatten

PAGE = 4096


def make_state(total: int, count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` tensors of about ``total`` bytes together; every 8th one bfloat16."""
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0.0, 1.5, count)
    sizes = np.maximum(1, (weights / weights.sum() * total / 4).astype(np.int64))
    state = {}
    for i, n in enumerate(sizes):
        dtype = torch.bfloat16 if i % 8 == 7 else torch.float32
        # Twice the elements for 2-byte dtypes keeps the byte count; fill_ touches every page.
        t = torch.empty(int(n) * 4 // (torch.finfo(dtype).bits // 8), dtype=dtype)
        state[f"layer{i}.weight"] = t.fill_(i % 7 + 0.5)
    return state


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_memcpy(nbytes: int, repeat: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    dst[::PAGE] = 1  # pre-touch
    return median_time(lambda: np.copyto(dst, src), repeat)


def bench_elasticd(state, root: str, repeat: int) -> tuple[float, float]:
    store = SlotStore(root)
    try:
        def stall():
            flat = flatten({"model": state})
            lay = flat.layout("bench")
            slot = store.reserve("bench", 0, lay.total_size)
            copy_into(flat.tensors, slot.buffer, lay)
            return slot, SnapshotHeader("bench", 0, 0, 0, 1, lay, flat.meta)

        store.complete(*stall())  # warm-up: allocates and pre-touches both slots
        store.complete(*stall())
        stalls, seals = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            slot, header = stall()
            t1 = time.perf_counter()
            store.complete(slot, header)
            t2 = time.perf_counter()
            stalls.append(t1 - t0)
            seals.append(t2 - t1)
        return statistics.median(stalls), statistics.median(seals)
    finally:
        store.close()


def bench_torch_save(state, disk_dir: str, repeat: int) -> float:
    path = os.path.join(disk_dir, f"elasticd-bench-{uuid.uuid4().hex[:8]}.pt")

    def save():
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    try:
        return median_time(save, repeat)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="state size (MiB)")
    parser.add_argument("--tensors", type=int, default=300, help="number of tensors")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--root", default=None, help="slot store directory (default: /dev/shm)")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(), help="torch.save target")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    state = make_state(args.size_mib << 20, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = args.root or f"/dev/shm/elasticd-bench-{uuid.uuid4().hex[:8]}"

    rows = [("memcpy (numpy, pre-touched)", bench_memcpy(nbytes, args.repeat))]
    stall, seal_time = bench_elasticd(state, root, args.repeat)
    rows.append(("elasticd stall (flatten+copy)", stall))
    rows.append(("elasticd seal (xxh3+header)", seal_time))
    rows.append(("torch.save+fsync", bench_torch_save(state, args.disk_dir, args.repeat)))

    print(f"state: {nbytes / 2**20:.0f} MiB in {len(state)} tensors; torch threads "
          f"{torch.get_num_threads()}; median of {args.repeat}")
    print(f"{'what':<32} {'seconds':>9} {'GB/s':>7} {'vs memcpy':>10}")
    base = nbytes / rows[0][1]
    for name, seconds in rows:
        rate = nbytes / seconds
        print(f"{name:<32} {seconds:>9.4f} {rate / 1e9:>7.2f} {rate / base:>9.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_bytes": nbytes, "tensors": len(state), "repeat": args.repeat,
                       "torch_threads": torch.get_num_threads(),
                       "seconds": {name: seconds for name, seconds in rows}}, f, indent=1)


if __name__ == "__main__":
    main()

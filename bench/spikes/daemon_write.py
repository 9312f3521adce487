"""Spike (issue 30, restore39): would the daemon writing a restore's rows straight into the
worker's live tensors (``process_vm_writev`` from a small, cache-hot buffer it has just checked)
cost less CPU than the worker's own copy out of restore scratch? restore38 named it the one
lever of the size the CPU point needs (the workers' copy, ~0.14 s a restore).

Each way on the same bytes (``--mib``, default one worker's rows in the sharded bench),
interleaved, ``--reps`` times, CPU seconds of the process that does the copy:

* ``worker_memmove``: today's path (``elasticd/worker/slot_rows.py``): one ``memmove`` per
  8 MiB piece out of a kept mapping of a scratch file (``/dev/shm``, small pages, touched)
  into touched anonymous memory (the live tensors);
* ``hot_memmove``: one ``memmove`` per MiB from one 1 MiB buffer into touched anonymous
  memory, in one process: what any "write from a cache-hot buffer" scheme costs at least;
* ``vm_writev_1m`` / ``vm_writev_16m``: ``process_vm_writev`` from that 1 MiB buffer into
  another process's touched memory, one MiB a call / sixteen iovecs of a MiB a call (the
  kernel pins each remote page, then copies).

    cpulock python bench/spikes/daemon_write.py --reps 5 --out bench/results/restore39/daemon_write.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import tempfile
import time

MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                                    ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_writev.restype = ctypes.c_ssize_t


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _touched(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)
    buf.write(b"\1" * nbytes)
    return buf


def _target(nbytes: int, conn) -> None:
    """The worker: live memory, touched; reports its pid and address, waits to be told to go."""
    live = _touched(nbytes)
    conn.send((os.getpid(), _address(live)))
    conn.recv()
    conn.send(live[::4096].count(b"\1"))  # a read, so the writes are not lost on an unused map


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=385)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    nbytes = args.mib * MIB
    hot = _touched(MIB)
    hot_at = _address(hot)
    live = _touched(nbytes)
    live_at = _address(live)
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        f.truncate(nbytes)
        scratch = mmap.mmap(f.fileno(), nbytes)
        scratch.write(os.urandom(MIB) * args.mib)  # touched, as a kept scratch mapping is
        scratch_at = _address(scratch)
        parent, child = mp.Pipe()
        proc = mp.get_context("fork").Process(target=_target, args=(nbytes, child))
        proc.start()
        pid, remote = parent.recv()

        def worker_memmove() -> None:
            for off in range(0, nbytes, 8 * MIB):
                ctypes.memmove(live_at + off, scratch_at + off, min(8 * MIB, nbytes - off))

        def hot_memmove() -> None:
            for off in range(0, nbytes, MIB):
                ctypes.memmove(live_at + off, hot_at, MIB)

        def vm_writev(per_call: int):
            def run() -> None:
                for off in range(0, nbytes, per_call * MIB):
                    k = min(per_call, (nbytes - off) // MIB)
                    local = (_Iovec * k)(*[_Iovec(hot_at, MIB)] * k)
                    far = (_Iovec * k)(*[_Iovec(remote + off + i * MIB, MIB) for i in range(k)])
                    if _libc.process_vm_writev(pid, local, k, far, k, 0) != k * MIB:
                        raise OSError(ctypes.get_errno(), "process_vm_writev")
            return run

        ways = {"worker_memmove": worker_memmove, "hot_memmove": hot_memmove,
                "vm_writev_1m": vm_writev(1), "vm_writev_16m": vm_writev(16)}
        cpu: dict[str, list[float]] = {w: [] for w in ways}
        try:
            for _ in range(args.reps):
                for name, way in ways.items():
                    start = time.thread_time()
                    way()
                    cpu[name].append(time.thread_time() - start)
            parent.send("go")
            assert parent.recv() == nbytes // 4096, "the target's memory was not written"
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            scratch.close()
    gib = nbytes / (1 << 30)
    result = {"benchmark": "daemon_write spike (issue 30, restore39)", "mib": args.mib,
              "reps": args.reps, "cpu_seconds": cpu,
              "median_cpu_seconds_per_gib": {w: round(statistics.median(v) / gib, 4)
                                             for w, v in cpu.items()},
              "over_worker_memmove": {w: round(statistics.median(v)
                                               / statistics.median(cpu["worker_memmove"]), 2)
                                      for w, v in cpu.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

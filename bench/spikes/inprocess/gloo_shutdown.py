"""Does shutting down a gloo group's connections end a pending collective, on torch 2.13 CPU?
(issue 31; gloo_timeout.py found that ``abort()`` and ``shutdown()`` do not.)

Two gloo ranks, a group timeout of 10 s, a 64 MiB tensor (rank 0's send is still pending when
it is cut). After one all_reduce together, rank 1 goes silent for 1 s (sleeps with its sockets
open, as a frozen peer) and rank 0 starts another all_reduce; a thread of rank 0 shuts down
sockets of the group 0.5 s into it (:func:`elasticd.worker.group_sockets.shut_down`; the
descriptors stay open): ``connections``, the group's connected pairs
(:func:`~elasticd.worker.group_sockets.connections`), or ``all``, every socket
``init_process_group`` opened, gloo's listener too (what an earlier spike did,
``freeze_unstick_sockets.json``: every survivor died of SIGABRT). Recorded: how rank 0's
operation ended and when, and how rank 1's next all_reduce ends (the peer's side), or the
processes' exit codes when they did not report::

    .venv/bin/python bench/spikes/inprocess/gloo_shutdown.py \\
        --out bench/results/spikes/inprocess/gloo_shutdown.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticd.worker import group_sockets


def _sockets() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.add(int(name))
        except OSError:
            pass
    return out


def _ended(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        ended = "returned"
    except Exception as exc:  # noqa: BLE001 - what ends it is the result
        ended = f"{type(exc).__name__}: {str(exc)[:160]}"
    return {"ended": ended, "op_seconds": round(time.monotonic() - t0, 3)}


def _worker(rank: int, port: int, out: str, which: str) -> None:
    torch.set_num_threads(1)
    before = _sockets()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=10))
    opened = _sockets() - before
    conns = group_sockets.connections(opened, port) if which == "connections" else opened
    t = torch.ones(16 << 20)
    dist.all_reduce(t)
    result: dict = {"shut": which, "rank": rank, "sockets_to_shut": len(conns)}
    if rank == 1:
        time.sleep(1.0)
        result.update(_ended(lambda: dist.all_reduce(t)))
    else:
        def later() -> None:
            time.sleep(0.5)
            result["shut_down"] = group_sockets.shut_down(conns)
        threading.Thread(target=later, daemon=True).start()
        result.update(_ended(lambda: dist.all_reduce(t)))
    t1 = time.monotonic()
    dist.destroy_process_group()
    result["destroy_seconds"] = round(time.monotonic() - t1, 4)
    result["sockets_open_after_destroy"] = len(conns & _sockets())
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(result, fh)
    os._exit(0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/spikes/inprocess/gloo_shutdown.json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    runs = []
    with tempfile.TemporaryDirectory() as d:
        for which in ("connections", "all"):
            path = os.path.join(d, which)
            port = _port()
            ps = [ctx.Process(target=_worker, args=(r, port, path, which)) for r in (0, 1)]
            for p in ps:
                p.start()
            for p in ps:
                p.join(60)
            for r, p in enumerate(ps):
                if os.path.exists(f"{path}.{r}"):
                    with open(f"{path}.{r}") as fh:
                        runs.append(json.load(fh))
                else:
                    runs.append({"shut": which, "rank": r, "exitcode": p.exitcode})
                print(runs[-1], flush=True)
    with open(args.out, "w") as fh:
        json.dump({"spike": "gloo_shutdown", "torch": torch.__version__,
                   "command": "bench/spikes/inprocess/gloo_shutdown.py --out " + args.out,
                   "note": "not under the CPU lock: the question is whether the operation ends "
                           "at the shutdown (0.5 s) or at the group timeout (10 s)",
                   "runs": runs}, fh, indent=2)


if __name__ == "__main__":
    main()

"""What ends a gloo collective waiting on a silent peer, on torch 2.13 CPU (issue 31).

Two gloo ranks; after one all_reduce together, rank 1 goes silent (sleeps with its sockets
open, as a frozen or partitioned peer: nothing sent, no reset) and rank 0 starts another
all_reduce. Modes:

* ``set``: the group made with a 30 s timeout, then ``_set_pg_timeout(2 s)`` before the op:
  does a live group's new timeout apply to the next operation?
* ``abort`` / ``shutdown``: the group's timeout 5 s; a thread calls the gloo backend's
  ``abort()`` / ``shutdown()`` 0.5 s into the op: does either end it?

    .venv/bin/python bench/spikes/inprocess/gloo_timeout.py \\
        --out bench/results/spikes/inprocess/gloo_timeout.json
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
from torch.distributed import distributed_c10d as c10d


def _worker(rank: int, mode: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30 if mode == "set" else 5))
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(40)
        os._exit(0)
    result: dict = {"mode": mode}
    be = c10d._get_default_group()._get_backend(torch.device("cpu"))
    if mode == "set":
        c10d._set_pg_timeout(datetime.timedelta(seconds=2), None)
        result["group_timeout_after_set"] = str(be.options._timeout)
    else:
        def later() -> None:
            time.sleep(0.5)
            t1 = time.monotonic()
            getattr(be, mode)()
            result[f"{mode}_call_seconds"] = round(time.monotonic() - t1, 6)
        threading.Thread(target=later, daemon=True).start()
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        result["ended"] = "returned"
    except Exception as exc:  # noqa: BLE001 - what ends it is the result
        result["ended"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    result["op_seconds"] = round(time.monotonic() - t0, 3)
    with open(out, "w") as fh:
        json.dump(result, fh)
    os._exit(0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/spikes/inprocess/gloo_timeout.json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = []
    with tempfile.TemporaryDirectory() as d:
        for mode in ("set", "abort", "shutdown"):
            path = os.path.join(d, mode)
            port = _port()
            ps = [ctx.Process(target=_worker, args=(r, mode, port, path)) for r in (0, 1)]
            for p in ps:
                p.start()
            ps[0].join(60)
            ps[1].kill()
            ps[1].join()
            with open(path) as fh:
                results.append(json.load(fh))
            print(results[-1], flush=True)
    with open(args.out, "w") as fh:
        json.dump({"spike": "gloo_timeout", "torch": torch.__version__,
                   "command": "bench/spikes/inprocess/gloo_timeout.py --out " + args.out,
                   "note": "not under the CPU lock: the figures are timeouts, seconds apart",
                   "runs": results}, fh, indent=2)


if __name__ == "__main__":
    main()

"""What the issue-31 spikes share: a controller's TCPStore, forkserver workers that have torch
imported (as elasticd's zygote gives), the simulated nodes, and process clean-up."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import signal
import socket
import statistics
import time
from typing import Any, Sequence

NODES, PER_NODE = 3, 2
WORLD = NODES * PER_NODE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forkserver(preload: Sequence[str] = ("torch", "torch.distributed")) -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def controller_store(port: int = 0) -> tuple[Any, int]:
    """The controller's TCPStore (the stand-in for the agents' channel), and its port."""
    import torch.distributed as dist

    port = port or free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True,
                         timeout=datetime.timedelta(seconds=180), use_libuv=True), port


def client(port: int, seconds: float = 120.0) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=seconds))


def node_ranks(node: int) -> list[int]:
    return [node * PER_NODE + i for i in range(PER_NODE)]


def wait_all(store: Any, keys: Sequence[str], seconds: float) -> None:
    """Waits until every key exists (``store.check`` polled: ``wait`` has no useful error)."""
    deadline = time.time() + seconds
    while not all(store.check([k]) for k in keys):
        if time.time() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise TimeoutError(f"keys not set within {seconds:.0f} s: {missing}")
        time.sleep(0.005)


def stop_all(procs: Sequence[Any]) -> list[int | None]:
    """SIGKILL (and SIGCONT, for a frozen one) to every process still running; their exit
    codes."""
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
                os.kill(p.pid, signal.SIGCONT)
    for p in procs:
        p.join(10)
    return [p.exitcode for p in procs]


def med(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def group_store(ctl: Any, key: str, rank: int, world: int, port: int = 0) -> Any:
    """A round's store: a fresh prefix over the controller's store, or (``port``) a fresh
    TCPStore hosted by the round's rank 0 with a fresh prefix (elasticd's rounds)."""
    import torch.distributed as dist

    if not port:
        return dist.PrefixStore(key, ctl)
    tcp = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=(rank == 0),
                        timeout=datetime.timedelta(seconds=30), use_libuv=True)
    return dist.PrefixStore(key, tcp)

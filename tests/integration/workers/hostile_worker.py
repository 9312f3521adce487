"""A worker that tries, against its own daemon, what a hostile job may (issue 26).

Usage: ``torchrun ... hostile_worker.py OUT_DIR MODE``; each mode writes what it got to
``OUT_DIR/<MODE>.json`` and then waits (at most 120 s) for ``OUT_DIR/done``, so that the test
reads the daemon's state while the job still runs.

* ``ranks`` (one rank): it registers with a terminal sequence as the reason its state cannot
  be snapshotted (finding 3: what an operator's ``elasticctl jobs`` and the daemon's log then
  show), then opens connection after connection, each claiming another rank (finding 5).
* ``scratch`` (two ranks, on two nodes, replication on): both snapshot until a step is
  committed; then rank 0 asks its daemon again and again for a partial copy of rank 1's shard
  (``ckpt_fetch`` with ``need``), never releasing one, and a child process of it asks once
  more (finding 6).
"""

import json
import os
import sys
import time

from elasticd.worker.client import DaemonClient, DaemonError

#: A window title, a screen clear and a forged log line.
HOSTILE = "\x1b]0;owned\x07\x1b[2J\nINFO forged: all good"


def claim_ranks(out: str) -> None:
    path, job = os.environ["ELASTICD_SOCKET"], os.environ["ELASTICD_JOB"]
    first = DaemonClient(path, timeout=10)
    first.call("register", job=job, rank=0, world_size=1, unsnapshottable=HOSTILE)
    first.call("progress", job=job, rank=0, step=1, world_size=1)
    got = {}
    clients = []
    for rank in [*range(1, 100), 10**6, 2**62]:
        client = DaemonClient(path, timeout=10)
        clients.append(client)  # every connection stays open
        try:
            client.call("register", job=job, rank=rank, world_size=rank + 1)
            got[rank] = "ok"
        except DaemonError as exc:
            got[rank] = str(exc)
        try:
            client.call("progress", job=job, rank=rank, step=1, world_size=rank + 1)
        except DaemonError:
            pass
    write_json(os.path.join(out, "ranks.json"), {"pid": os.getpid(), "got": got})


def write_json(path: str, obj) -> None:
    """Writes ``obj`` whole or not at all: the test reads the file as soon as it exists (a CI
    run read 8 KiB of a 13 KiB file written in place)."""
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh)
    os.replace(path + ".tmp", path)


def fetch_scratch(out: str) -> None:
    import torch
    import torch.distributed as dist

    import elasticd

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"model": torch.nn.Linear(256, 768)}  # a 768 KiB shard per rank
    ckpt = elasticd.Checkpointer(every=1)
    path, job = os.environ["ELASTICD_SOCKET"], os.environ["ELASTICD_JOB"]
    client = DaemonClient(path, timeout=30)
    committed, step = None, 0
    deadline = time.monotonic() + 90
    while committed is None and time.monotonic() < deadline:
        step += 1
        ckpt.save(step, state)
        time.sleep(0.2)
        reply = client.call("ckpt_committed", job=job)
        committed = reply if reply.get("committed", True) is not None else None
    ckpt.close()
    if rank != 0:
        return
    version = {"generation": committed["generation"], "step": committed["step"]}

    def fetch(c: DaemonClient, target: int) -> dict:
        try:
            reply = c.call("ckpt_fetch", job=job, rank=target, need=[], **version)
        except DaemonError as exc:
            return {"error": str(exc)}
        for fd in reply.pop("_fds", []):
            os.close(fd)  # the pin holds the copy; this worker never releases it
        return reply

    # A rank whose copy this node does not hold (a held one is served in place, no scratch).
    world = int(os.environ["WORLD_SIZE"])
    first, target = {}, 1
    for target in range(1, world):
        first = fetch(client, target)
        if first.get("partial"):
            break
    got = {"target": target, "fetches": [first] + [fetch(client, target) for _ in range(2)]}
    child = os.fork()
    if child == 0:  # another process of the job, on a connection of its own
        reply = fetch(DaemonClient(path, timeout=30), target)
        write_json(os.path.join(out, "child.json"), reply)
        os._exit(0)
    os.waitpid(child, 0)
    with open(os.path.join(out, "child.json")) as fh:
        got["child"] = json.load(fh)
    write_json(os.path.join(out, "scratch.json"), got)


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "ranks":
        claim_ranks(out)
    elif mode == "scratch":
        fetch_scratch(out)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "done")) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    main()

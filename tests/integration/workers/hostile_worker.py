"""A worker that tries, against its own daemon, what a hostile job may (issue 26).

Usage: ``torchrun ... hostile_worker.py OUT_DIR ranks``. As the job's rank 0 it registers
with a terminal sequence as the reason its state cannot be snapshotted (finding 3: what an
operator's ``elasticctl jobs`` and the daemon's log then show), then opens connection after
connection, each claiming another rank (finding 5), and writes what each got to
``OUT_DIR/ranks.json``. It then waits (at most 120 s) for ``OUT_DIR/done``, so that the test
reads the daemon's state while the job still runs.
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
    with open(os.path.join(out, "ranks.json"), "w") as fh:
        json.dump({"pid": os.getpid(), "got": got}, fh)


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "ranks":
        claim_ranks(out)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "done")) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    main()

"""A tiny torchrun worker: one gloo all_reduce, then a clean exit.

Usage: ``torchrun ... allreduce.py EXPECTED_WORLD_SIZE [SECONDS]``. Each rank contributes
rank + 1, so the sum is n(n+1)/2. With SECONDS, it keeps all-reducing (10 a second) for that
long before reporting, to stand for a job that trains through some event; the ranks decide
together when that time is up (a flag summed in the same all_reduce), since each rank's own clock
could stop one rank a step before the other, leaving it in an all_reduce with a peer that has
exited. It exits with ``os._exit(0)`` after tearing down the process group: about
1 in 13 short jobs otherwise died with SIGABRT ("terminate called without an active exception")
after ``destroy_process_group()`` (docs/facts.md).
"""

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    expected_world = int(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != expected_world:
        print(f"ALLREDUCE wrong world size {world}, expected {expected_world}", flush=True)
        os._exit(3)
    end = time.monotonic() + seconds
    steps = 0
    while True:
        t = torch.tensor([float(rank + 1), float(time.monotonic() >= end)])
        dist.all_reduce(t)
        steps += 1
        if t[1].item() > 0:
            break
        time.sleep(0.1)
    print(f"ALLREDUCE rank={rank} world={world} sum={t[0].item():g} "
          f"share_store={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""Two DDP ranks over gloo, one slowed in its forward: each rank's compute time per step
(elasticd.worker.compute_time.ComputeTimer) against its step time.

Usage: ``ddp_compute.py RANK WORLD PORT SLOW_RANK SLOW_SECONDS STEPS``; prints one JSON line
``{"rank": R, "compute": [...], "step": [...]}``.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elasticd.worker.compute_time import ComputeTimer


class Slow(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.lin = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 1)

    def forward(self, x):
        time.sleep(self.seconds)  # a slow node: its own compute
        return self.out(torch.relu(self.lin(x)))


def main() -> None:
    rank, world, port, slow_rank, slow, steps = (int(sys.argv[1]), int(sys.argv[2]),
                                                 int(sys.argv[3]), int(sys.argv[4]),
                                                 float(sys.argv[5]), int(sys.argv[6]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model = DDP(Slow(slow if rank == slow_rank else 0.0))
    timer = ComputeTimer()
    model.register_comm_hook(None, timer.ddp_hook())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compute, step_times = [], []
    for _ in range(steps):
        began = time.monotonic()
        timer.start()
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        compute.append(timer.stop())
        step_times.append(time.monotonic() - began)
    print(json.dumps({"rank": rank, "compute": compute, "step": step_times}), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: gloo can SIGABRT in teardown after destroy_process_group


if __name__ == "__main__":
    main()

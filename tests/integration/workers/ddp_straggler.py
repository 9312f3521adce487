"""A DDP job under torchrun whose workers on one node are slow in their forward: the
straggler test's worker.

Usage: ``ddp_straggler.py --steps N --slow-node NODE --slow S``. Each step times its own
compute with :class:`elasticd.worker.compute_time.ComputeTimer` (a timed DDP communication
hook) and reports it with the step (``elasticd.worker.progress``); on node NODE
(``ELASTICD_NODE``) every forward sleeps S seconds first. Prints ``step K world W node X
t=<wall clock>`` per step and ``done node X world W`` at the end. A new attempt (after a peer
left) starts at step 0 again: the test looks at step rates, not at resumed state.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elasticd.worker import progress
from elasticd.worker.compute_time import ComputeTimer


class Model(torch.nn.Module):
    def __init__(self, slow: float) -> None:
        super().__init__()
        self.slow = slow
        self.lin = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 1)

    def forward(self, x):
        if self.slow:
            time.sleep(self.slow)  # a slow machine: this node's own compute
        return self.out(torch.relu(self.lin(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--slow-node", required=True)
    p.add_argument("--slow", type=float, required=True)
    p.add_argument("--step-sleep", type=float, default=0.02)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    node, world = os.environ.get("ELASTICD_NODE", "?"), dist.get_world_size()
    model = DDP(Model(args.slow if node == args.slow_node else 0.0))
    timer = ComputeTimer()
    model.register_comm_hook(None, timer.ddp_hook())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        timer.start()
        time.sleep(args.step_sleep)  # every node's own share of work
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        progress(step, compute_seconds=timer.stop())
        print(f"step {step} world {world} node {node} t={time.time():.3f}", flush=True)
    print(f"done node {node} world {world}", flush=True)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # docs/facts.md: gloo can SIGABRT in teardown after destroy_process_group


if __name__ == "__main__":
    main()

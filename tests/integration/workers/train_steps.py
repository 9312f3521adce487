"""A torchrun worker that trains until killed: one gloo all_reduce per step, progress on stdout.

Usage: ``torchrun ... train_steps.py [SECONDS]``. Each step averages a tiny model's gradients
across the ranks and prints one line::

    STEP node=<ELASTICD_TEST_NODE> rank=R world=W step=N restart=<TORCHELASTIC_RESTART_COUNT>
         pid=P t=<wall clock>

so a test can tell when the survivors of a failure train again, at which world size, and
whether a worker was restarted. It gives up after SECONDS (default 300), so that a worker the
test failed to kill does not train forever. When a peer dies, the all_reduce raises (gloo gets a
connection reset) and the worker exits non-zero: torchrun restarts it.
"""

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("ELASTICD_TEST_NODE", "?")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < end:
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        print(f"STEP node={node} rank={rank} world={world} step={step} restart={restart} "
              f"pid={os.getpid()} t={time.time():.3f}", flush=True)
        time.sleep(0.1)
    dist.destroy_process_group()
    os._exit(0)  # docs/facts.md: avoids the occasional SIGABRT after destroy_process_group()


if __name__ == "__main__":
    main()

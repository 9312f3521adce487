"""A torchrun worker whose steps take the times it is told, for hang detection's tests.

Usage: ``step_times.py --steps N --step-min S --step-max S [--alternate] [--first-step S]
[--hang-rank R --hang-at-step K]``. Each step sleeps a time drawn uniformly from [step-min,
step-max] (seeded: every rank draws the same; with ``--alternate``, step-min on odd steps and
step-max on even ones), then all-reduces a tensor over gloo and reports the step to the daemon
(``elasticd.worker.progress``); step 0 is reported before the first step, so that the first
interval holds the first step's extra ``--first-step`` seconds (a compile, a data loader
warming up). Rank R sleeps for an hour at step K of the first attempt (no progress, the other
ranks wait in the all_reduce), printing ``rank R hangs at step K t=<wall clock>`` first.
Prints ``step N world W rank R restart C`` per step and ``done rank R`` at the end.
"""

import argparse
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from elasticd.worker import progress


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-min", type=float, required=True)
    p.add_argument("--step-max", type=float, required=True)
    p.add_argument("--alternate", action="store_true")
    p.add_argument("--first-step", type=float, default=0.0)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-at-step", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rnd = random.Random(1234)
    progress(0)
    for step in range(1, args.steps + 1):
        if rank == args.hang_rank and step == args.hang_at_step and restart == 0:
            print(f"rank {rank} hangs at step {step} t={time.time():.3f}", flush=True)
            time.sleep(3600)
        extra = args.first_step if step == 1 else 0.0
        if args.alternate:
            pause = args.step_min if step % 2 else args.step_max
        else:
            pause = rnd.uniform(args.step_min, args.step_max)
        time.sleep(pause + extra)
        t = torch.ones(4)
        dist.all_reduce(t)
        progress(step)
        print(f"step {step} world {world} rank {rank} restart {restart}", flush=True)
    print(f"done rank {rank}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: avoids the occasional SIGABRT after destroy_process_group()


if __name__ == "__main__":
    main()

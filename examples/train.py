"""A small deterministic training job for elasticd: DDP over gloo on CPU, checkpointed every
step into the node daemon's RAM.

The distributed setup order matters and is the one to copy: process group first, then the
data loader with its sampler (which asks the process group for rank and world size), then the
model wrapped in DDP, then ``restore``. Each step is snapshotted (the copy overlaps the next
step) and reported to the daemon (hang detection); without a daemon the script runs unchanged
and starts from step 0 after a restart.

    torchrun --nproc-per-node 2 examples/train.py --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elasticd
from elasticd.worker import progress


def make_data(n: int = 4096, dim: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


class Indexed(torch.utils.data.Dataset):
    """``dataset`` whose items also carry their index (for ``--sample-log``)."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return (*self.dataset[i], i)


def _sample_log(directory: str, rank: int, world: int):
    """A function that records one step's sample indices, or None without ``directory``.

    Each worker process appends to a file of its own. Records carry an attempt id that every
    rank of this process group shares (rank 0's start time, broadcast), so that a reader can
    tell which attempt's steps were kept: for each step, the latest attempt that ran it.
    """
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    attempt = torch.tensor([time.time_ns()], dtype=torch.int64)
    dist.broadcast(attempt, 0)
    fh = open(os.path.join(directory, f"samples-{attempt.item()}-rank{rank}-{os.getpid()}.jsonl"),
              "a", buffering=1)

    def record(step: int, epoch: int, indices: list[int]) -> None:
        fh.write(json.dumps({"attempt": attempt.item(), "rank": rank, "world": world,
                             "step": step, "epoch": epoch, "t": round(time.time(), 4),
                             "indices": indices}) + "\n")

    return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    p.add_argument("--hang-rank", type=int, default=-1, help="this rank stops progressing...")
    p.add_argument("--hang-at-step", type=int, default=-1, help="...at this step (first attempt)")
    p.add_argument("--out", default="", help="rank 0 writes the final weights here")
    p.add_argument("--hidden", type=int, default=64,
                   help="hidden width (state size: bench/bench_peer_timeline.py uses ~1.3M)")
    p.add_argument("--zero", action="store_true",
                   help="ZeroRedundancyOptimizer: optimizer state sharded across ranks")
    p.add_argument("--sample-log", default="",
                   help="directory where each worker appends the sample indices of every step "
                        "(JSON lines; the chaos tests check every sample is seen exactly once)")
    args = p.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # 1. the process group
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    data = make_data()
    if args.sample_log:
        data = Indexed(data)  # batches carry their sample indices
    # 2. the sampler (its position in the epoch is checkpointed), then the loader
    # pad=False: no sample repeated at an epoch's end (the chaos suite checks each one is
    # trained exactly once); 4096 samples still give every rank the same batch count.
    sampler = elasticd.ElasticSampler(data, shuffle=True, seed=0, pad=False)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(0))
    # 3. the wrapped model. find_unused_parameters=True keeps DDP's gradient buckets in one
    # order for the whole run (otherwise they are rebuilt after the first iteration, a resumed
    # process sums gradients in another order and drifts ~1e-7 from an uninterrupted run).
    net = torch.nn.Sequential(torch.nn.Linear(32, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, 1))
    model = DDP(net, find_unused_parameters=True)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                      lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    # 4. restore: the newest step every rank holds (daemon RAM, a peer, or the disk tier)
    state = {"model": model, "optim": opt, "sampler": sampler, "rng": elasticd.RNGState(),
             "epoch": 0}
    ckpt = elasticd.Checkpointer(every=1)
    step = ckpt.restore(state)
    epoch = state["epoch"]
    r = ckpt.last_restore
    print(f"start rank {rank} world {world} restart {restart} pid {os.getpid()} "
          f"restored step {step} from {r.source if r else 'none'} "
          f"in {r.seconds if r else 0:.3f} s, steps lost {r.steps_lost if r else 0}", flush=True)
    samples = _sample_log(args.sample_log, rank, world)
    while step < args.steps:
        sampler.set_epoch(epoch)
        state["epoch"] = epoch
        for x, y, *index in loader:
            if step >= args.steps:
                break
            if rank == args.hang_rank and step == args.hang_at_step and restart == 0:
                print(f"rank {rank} hangs at step {step}", flush=True)
                time.sleep(3600)  # no progress; the other ranks block in all_reduce
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if samples is not None:
                samples(step, epoch, index[0].tolist())
            ckpt.save(step, state)
            progress(step)
            print(f"step {step} world {world} rank {rank} restart {restart} "
                  f"loss {loss.item():.5f}", flush=True)
            if args.step_time:
                time.sleep(args.step_time)
        epoch += 1

    ckpt.close()
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save({k: v.clone() for k, v in model.module.state_dict().items()},
                   os.path.join(args.out, "final.pt"))
    print(f"done rank {rank} world {world} steps {step}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: avoids a rare SIGABRT after destroy_process_group


if __name__ == "__main__":
    sys.exit(main())

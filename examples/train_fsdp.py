"""A small deterministic FSDP2 training job for elasticd: parameters and Adam state sharded
across ranks (``fully_shard``, DTensor) over gloo on CPU, snapshotted every step into the node
daemon's RAM without gathering anything: each rank stores its own shards.

The setup order is the one to copy: process group first, then the data loader with its sampler
(which asks the process group for rank and world size), then ``fully_shard`` on each layer and
on the whole model, then the optimizer, then ``restore``. After a node is lost (or joins), the
new world's ranks reshard the committed step from the old ranks' snapshots, its own node's RAM
first, then its peers'. Layer widths are not divisible by 2 or 3, so FSDP2's shards are uneven.

    torchrun --nproc-per-node 3 examples/train_fsdp.py --steps 50
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import elasticd
from elasticd.worker import progress

WIDTHS = (32, 37, 41, 29, 23, 19, 13, 7, 1)  # 8 Linear layers


def make_data(n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, WIDTHS[0], generator=g)
    w = torch.randn(WIDTHS[0], 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def make_model() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)  # each layer's parameters sharded on dim 0 across the ranks
    fully_shard(model)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    args = p.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # 1. the process group
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    data = make_data()
    # 2. the sampler (its position in the epoch is checkpointed), then the loader
    sampler = elasticd.ElasticSampler(data, shuffle=True, seed=0, pad=False)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(0))
    model = make_model()  # 3. fully_shard, then the optimizer over the sharded parameters
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    # 4. restore: the newest step every rank can load, resharded if the world size changed
    state = {"model": model, "optim": opt, "sampler": sampler, "rng": elasticd.RNGState(),
             "epoch": 0}
    ckpt = elasticd.Checkpointer(every=1)
    step = ckpt.restore(state)
    epoch = state["epoch"]
    r = ckpt.last_restore
    print(f"start rank {rank} world {world} restart {restart} pid {os.getpid()} "
          f"restored step {step} from {r.source if r else 'none'} "
          f"in {r.seconds if r else 0:.3f} s, steps lost {r.steps_lost if r else 0}", flush=True)
    while step < args.steps:
        sampler.set_epoch(epoch)
        state["epoch"] = epoch
        for x, y in loader:
            if step >= args.steps:
                break
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            ckpt.save(step, state)
            progress(step)
            print(f"step {step} world {world} rank {rank} restart {restart} "
                  f"loss {loss.item():.5f}", flush=True)
            if args.step_time:
                time.sleep(args.step_time)
        epoch += 1

    ckpt.close()
    print(f"done rank {rank} world {world} steps {step}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: avoids a rare SIGABRT after destroy_process_group


if __name__ == "__main__":
    sys.exit(main())

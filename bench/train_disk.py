"""The plain-torchrun baseline's training script: examples/train.py's model, data and step, with
a disk checkpoint every ``--every`` steps instead of elasticd (what a torchrun job does today).

Rank 0 writes the model and optimizer state with ``torch.save`` to ``--ckpt-dir`` (write, fsync,
rename: a torn file is never loaded); on every (re)start each rank loads the newest one. It
prints the same ``start ...`` and ``step ...`` lines as examples/train.py, so
bench/bench_recovery.py reads both jobs' logs alike. Run only under torchrun::

    torchrun --nproc-per-node 2 bench/train_disk.py --ckpt-dir /tmp/ck --every 10 --steps 50
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from train import make_data  # noqa: E402 — the example's data, not a copy of it

CKPT = "ckpt.pt"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", required=True, help="where rank 0 writes checkpoints")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    args = p.parse_args()
    if args.every < 1:
        p.error(f"--every must be >= 1, got {args.every}")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    path = os.path.join(args.ckpt_dir, CKPT)
    step, source, t0 = 0, "none", time.perf_counter()
    if os.path.exists(path):
        saved = torch.load(path)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        step, source = saved["step"], "disk"
    print(f"start rank {rank} world {world} restart {restart} pid {os.getpid()} "
          f"restored step {step} from {source} in {time.perf_counter() - t0:.3f} s", flush=True)

    data = make_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    epoch = 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step >= args.steps:
                break
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % args.every == 0:
                tmp = f"{path}.tmp"
                with open(tmp, "wb") as f:
                    torch.save({"model": model.module.state_dict(),
                                "optim": opt.state_dict(), "step": step}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            print(f"step {step} world {world} rank {rank} restart {restart} "
                  f"loss {loss.item():.5f}", flush=True)
            if args.step_time:
                time.sleep(args.step_time)
        epoch += 1
    print(f"done rank {rank} world {world} steps {step}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: avoids a rare SIGABRT after destroy_process_group


if __name__ == "__main__":
    sys.exit(main())

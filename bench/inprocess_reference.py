"""One failure-free segment of ``bench/loss_curves.py --mode in-process``'s reference: the
training of examples/train_in_process.py (its :func:`make_process`, :func:`make_round` and
:func:`batch`, imported, so the reference trains exactly what the job trains) under a plain
gloo group of ``WORLD_SIZE`` ranks, no elasticd: from ``--resume`` (a DCP save of the last
segment, ``dcp.load`` at this world size) or step 0, to ``--steps``; saves that step with
``dcp.save(get_state_dict(...))`` into ``--save`` and writes each step's loss to ``--log``.

    RANK=r WORLD_SIZE=w MASTER_ADDR=... MASTER_PORT=... python bench/inprocess_reference.py \\
        --model fsdp --first 0 --steps 30 --save DIR --log DIR [--resume DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def example():
    spec = importlib.util.spec_from_file_location(
        "train_in_process", os.path.join(REPO, "examples", "train_in_process.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("ddp", "fsdp"), required=True)
    p.add_argument("--first", type=int, required=True, help="the step the save resumed holds")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--save", required=True)
    p.add_argument("--log", required=True)
    args = p.parse_args()

    torch.set_num_threads(1)
    ex = example()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kept = ex.make_process(args.model)
    state, net = ex.make_round(args.model, kept)
    model, opt = state["model"], state["optim"]
    net = DDP(kept["inner"]) if net is None else net
    if args.resume:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    os.makedirs(args.log, exist_ok=True)
    with open(os.path.join(args.log, f"w{world}-r{rank}-{args.first}.jsonl"), "w") as out:
        for step in range(args.first, args.steps):
            loss = net(ex.batch(step, rank)).pow(2).mean()  # the job's step, as it runs it
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.write(json.dumps({"world": world, "rank": rank, "step": step + 1,
                                  "loss": loss.item()}) + "\n")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.save)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: avoids a rare SIGABRT after destroy_process_group


if __name__ == "__main__":
    sys.exit(main())

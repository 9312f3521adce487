"""A DDP job whose surviving workers keep their processes through a failure (issue 31).

Submit it in in-process mode::

    elasticctl submit demo --in-process --nnodes 2:3 --nproc-per-node 2 --user train -- \\
        /opt/jobs/train_in_process.py --log /shared/steps

The model, its optimizer and everything expensive are built once per process; the decorated
function is re-entered after each re-formation with a new default group, around which it
builds DDP again. Each round starts from the newest step every rank holds: a survivor keeps
the model of each of its last steps in memory, a fresh process holds step 0 only (this example
keeps no checkpoint: see ``examples/train.py`` for ``elasticd.Checkpointer``, whose in-process
restore is not built yet). The same script runs under plain ``torchrun`` (the function is
called once).

Each step appends a JSON line to ``--log``/``steps-<pid>.jsonl``: pid, round, rank, world,
step, path (``first``/``in-process``), time. ``--hang-rank R`` makes the worker of first-round
rank R hang instead of leaving its group on a failure (the fallback's test).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import elasticd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--hang-rank", type=int, default=-1)
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    held = {0: copy.deepcopy(model.state_dict())}  # step -> the model after it
    state = {"step": 0, "first_rank": None}
    out = open(os.path.join(args.log, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)

    @elasticd.in_process(timeout=30)
    def train(r: elasticd.Round) -> None:
        if state["first_rank"] is None:
            state["first_rank"] = r.rank
        ddp = DDP(model)
        # The newest step every rank of the round holds (a fresh process holds 0 only).
        newest = torch.tensor([state["step"]])
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        start = int(newest.item())
        if start != state["step"]:
            model.load_state_dict(held.get(start, held[0]))
            start = start if start in held else 0
        state["step"] = start
        try:
            while state["step"] < args.steps:
                r.check()
                step = state["step"]
                g = torch.Generator().manual_seed(step * 1000 + r.rank)
                loss = ddp(torch.randn(8, 32, generator=g)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                state["step"] = step + 1
                held[step + 1] = copy.deepcopy(model.state_dict())
                if step > 1:
                    held.pop(step - 1, None)  # keep step 0 and the last two
                out.write(json.dumps({"pid": os.getpid(), "round": r.number, "rank": r.rank,
                                      "world": r.world_size, "step": step + 1, "path": r.path,
                                      "t": time.time()}) + "\n")
                time.sleep(args.step_time)
        except Exception:
            if state["first_rank"] == args.hang_rank:
                time.sleep(3600)  # stuck: never leaves the group (the agent's deadline acts)
            raise

    train()
    out.write(json.dumps({"pid": os.getpid(), "done": state["step"]}) + "\n")
    out.close()


if __name__ == "__main__":
    main()

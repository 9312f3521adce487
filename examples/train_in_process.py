"""A DDP job whose surviving workers keep their processes through a failure (issue 31).

Submit it in in-process mode::

    elasticctl submit demo --in-process --nnodes 2:3 --nproc-per-node 2 --user train -- \\
        /opt/jobs/train_in_process.py --log /shared/steps

The model, its optimizer, the ``Checkpointer`` and everything expensive are built once per
process; the decorated function is re-entered after each re-formation with a new default
group. It restores first, every round: the ranks agree on the newest step every one of them
can load (a survivor from its node's RAM, a fresh or fallback worker from its node's RAM or a
peer's, as after a restart), each loads its new rank's shard, and new snapshots carry a new
generation. Then it builds DDP around the same module. The same script runs under plain
``torchrun`` (the function is called once).

Each step appends a JSON line to ``--log``/``steps-<pid>.jsonl``: pid, round, rank, world,
step, path (``first``/``in-process``), saved (whether its snapshot was taken: the daemon skips
one while both of the rank's slots hold copies the commit needs), loss (a step trained again
after a resume must repeat it bitwise), time, and on a re-entered
round's first step the moments of its re-formation (``times``: :attr:`elasticd.Round.times`,
then ``restored`` and ``ddp_built``). ``--hang-rank R`` makes the worker of first-round
rank R hang instead of leaving its group on a failure (the fallback's test). ``--compile
BACKEND`` compiles the inner module (``torch.compile(model, backend=...)``, DDP around it) and
each row carries ``compiles``: the graphs dynamo compiled in this process so far, which a
re-formation should leave unchanged (the same module, the same shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elasticd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--compile", default="", help="a torch.compile backend (e.g. aot_eager)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt}
    # Compiled once per process, outside the re-entered function: survivors keep the compiled
    # graph across re-formations (only DDP, around it, is rebuilt for the new group).
    inner = torch.compile(model, backend=args.compile) if args.compile else model
    # One Checkpointer for every round: each restore takes the rank the round gave.
    ckpt = elasticd.Checkpointer(every=1, replicated=("model",))
    first_rank: list[int] = []
    done = [0]
    out = open(os.path.join(args.log, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)

    @elasticd.in_process(timeout=30)
    def train(r: elasticd.Round) -> None:
        if not first_rank:
            first_rank.append(r.rank)
        step = ckpt.restore(state)  # every round, on every rank: the step they all resume at
        times = dict(r.times, restored=time.time()) if r.times else {}
        ddp = DDP(inner)
        if times:
            times["ddp_built"] = time.time()
        try:
            while step < args.steps:
                r.check()
                g = torch.Generator().manual_seed(step * 1000 + r.rank)
                loss = ddp(torch.randn(8, 32, generator=g)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                saved = ckpt.save(step, state)
                done[0] = step
                row = {"pid": os.getpid(), "round": r.number, "rank": r.rank,
                       "world": r.world_size, "step": step, "path": r.path, "saved": saved,
                       "loss": loss.item(), "t": time.time()}
                if args.compile:
                    row["compiles"] = compiles()
                if times:  # the round's first step: the moments of its re-formation
                    row["times"], times = times, {}
                out.write(json.dumps(row) + "\n")
                time.sleep(args.step_time)
        except Exception:
            if first_rank[0] == args.hang_rank:
                time.sleep(3600)  # stuck: never leaves the group (the agent's deadline acts)
            raise

    train()
    ckpt.close()
    out.write(json.dumps({"pid": os.getpid(), "done": done[0], "saves": ckpt.stats["saves"],
                          "failed": ckpt.stats["failed"]}) + "\n")
    out.close()


def compiles() -> int:
    """The graphs dynamo compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


if __name__ == "__main__":
    main()

"""A job whose surviving workers keep their processes through a failure (issue 31): DDP (the
default), FSDP2 (``--model fsdp``) or DDP with a ZeroRedundancyOptimizer (``--model zero``).

Submit it in in-process mode::

    elasticctl submit demo --in-process --nnodes 2:3 --nproc-per-node 2 --user train -- \\
        /opt/jobs/train_in_process.py --log /shared/steps

What lives where (the function is re-entered after each re-formation, with a new default
group; the process, and what it built outside the function, stay):

* Built once per process, outside the function: the ``Checkpointer``, the data, and for DDP the
  module, its compiled form and its optimizer (nothing of them holds the group).
* Built inside the function, every round, on the round's group: the DDP wrapper; a
  ZeroRedundancyOptimizer (it binds its group at construction: its partition depends on the
  world size); an FSDP2 model and its optimizer (``fully_shard`` binds the parameters' DTensors
  to the round's device mesh: after a shrink the survivors' shards are of the wrong size and on
  a mesh whose group is gone, so the model is made again, ``fully_shard`` on the new group, and
  ``restore`` loads it: each survivor's old shard from its own node's RAM, the rows it now
  needs that other old ranks held from theirs or from peers'). With torch 2.13 an FSDP2
  survivor's first re-formation still falls back to a restart: torch keeps the first round's
  group alive after ``fully_shard`` (docs/jobs.md, "Sharded state").
* Then ``restore`` first, every round, on every rank: the ranks agree on the newest step every
  one of them can load (a survivor of a DDP job from its own slot, the rank it was; sharded
  state — FSDP2, ZeRO — the committed step, resharded from the old ranks' snapshots, as after
  a restart), and new snapshots carry a new generation.

Nothing built inside may outlive the call (kept in a global, a closure or a cache): it holds
the old group, whose sockets then stay open and make the worker fall back to a restart. The
same script runs under plain ``torchrun`` (the function is called once).

Each step appends a JSON line to ``--log``/``steps-<pid>.jsonl``: pid, round, rank, world,
step, path (``first``/``in-process``), saved (whether its snapshot was taken: the daemon skips
one while both of the rank's slots hold copies the commit needs), loss (a step trained again
after a resume must repeat it bitwise), time, and on a re-entered
round's first step the moments of its re-formation (``times``: :attr:`elasticd.Round.times`,
then ``restored`` and ``ddp_built``; a staged newcomer's first step too). Before it asks for
its first round the script writes ``--log``/``ready-<pid>.json`` (pid, time). ``--hang-rank R`` makes the worker of first-round
rank R hang instead of leaving its group on a failure (the fallback's test). ``--compile
BACKEND`` compiles the inner module (DDP: ``torch.compile(model, backend=...)`` once, DDP
around it; FSDP2: each block's inner layers, inside the block ``fully_shard`` wraps, made again
with the model each round) and each row carries ``compiles``: the graphs dynamo compiled in
this process so far (DDP: a re-formation leaves it unchanged; FSDP2: the new round's modules
are new objects of the same code and shapes, and what dynamo does with them is measured).
``--loader-workers N`` draws each step's input through a ``DataLoader`` with N worker processes
(persistent, started before the first round, as a real script's loader is built before it
trains; the same tensors as :func:`batch`): each round re-enters the loader at its step and
rank, and the workers a survivor started stay; a restarted worker starts its own again.
``bench/bench_recovery.py --mode ... --compile aot_eager --loader-workers 2`` runs the job so.
``bench/loss_curves.py --mode in-process`` imports :func:`make_round` and :func:`batch` for
its failure-free reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elasticd

#: FSDP2's layer widths: none divisible by 4 or 6, so the shards are uneven at both worlds.
WIDTHS = (32, 37, 41, 29, 23, 13, 7, 1)


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input at ``step``: the same at any world size, after any restore."""
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(step * 1000 + rank))


class StepInputs(torch.utils.data.Dataset):
    """``--loader-workers``: item ``(step, rank)`` is :func:`batch`'s, made in a loader worker."""

    def __getitem__(self, key: tuple[int, int]) -> torch.Tensor:
        return batch(*key)


class FromStep(torch.utils.data.Sampler):
    """The keys one rank draws from ``start`` on; set before each round's ``iter(loader)``."""

    def __init__(self) -> None:
        self.start, self.rank = 0, 0

    def __iter__(self):
        return ((step, self.rank) for step in itertools.count(self.start))


def make_loader(workers: int) -> tuple[torch.utils.data.DataLoader, FromStep]:
    """A loader whose ``workers`` processes start now and outlive every iterator of it."""
    sampler = FromStep()
    loader = torch.utils.data.DataLoader(StepInputs(), batch_size=None, sampler=sampler,
                                         num_workers=workers, persistent_workers=True)
    iter(loader)  # starts the workers (persistent: each later iter() reuses them)
    return loader, sampler


class Block(torch.nn.Module):
    """One FSDP2 unit: ``fully_shard`` wraps the block, ``--compile`` its inner layers (FSDP2's
    hooks on the block itself are not traced by dynamo)."""

    def __init__(self, a: int, b: int, last: bool) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(a, b),
                                         *([] if last else [torch.nn.Tanh()]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def make_fsdp(backend: str = "") -> torch.nn.Module:
    """The FSDP2 model on the current default group: the same initial weights on every rank,
    every block and the root ``fully_shard``-ed."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    n = len(WIDTHS) - 1
    model = torch.nn.Sequential(*[Block(a, b, i == n - 1)
                                  for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:]))])
    for block in model:
        fully_shard(block)
        if backend:
            block.inner = torch.compile(block.inner, backend=backend)
    fully_shard(model)
    return model


def make_process(kind: str, backend: str = "") -> dict[str, Any]:
    """What one process keeps through every round: for DDP and ZeRO the module (and its
    compiled form); for DDP its optimizer too."""
    if kind == "fsdp":
        return {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    # Compiled once per process, outside the re-entered function: survivors keep the compiled
    # graph across re-formations (only DDP, around it, is rebuilt for the new group).
    kept = {"model": model, "inner": torch.compile(model, backend=backend) if backend else model}
    if kind == "ddp":
        kept["optim"] = torch.optim.SGD(model.parameters(), lr=0.01)
    return kept


def make_round(kind: str, kept: dict[str, Any], backend: str = "") -> tuple[dict, Any]:
    """The round's state (what ``restore`` loads and ``save`` snapshots) and the module to run,
    built on the round's default group."""
    if kind == "fsdp":
        model = make_fsdp(backend)
        return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.01)}, model
    if kind == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optim = ZeroRedundancyOptimizer(kept["model"].parameters(),
                                        optimizer_class=torch.optim.Adam, lr=0.01)
        return {"model": kept["model"], "optim": optim}, None
    return {"model": kept["model"], "optim": kept["optim"]}, None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--model", choices=("ddp", "fsdp", "zero"), default="ddp")
    ap.add_argument("--compile", default="", help="a torch.compile backend (e.g. aot_eager)")
    ap.add_argument("--setup-seconds", type=float, default=0.0,
                    help="sleep before asking for the first round: a real script's model "
                         "build and data loaders (what staging keeps from the survivors)")
    ap.add_argument("--loader-workers", type=int, default=0,
                    help="draw the input through a DataLoader with this many worker processes")
    args = ap.parse_args()
    if args.loader_workers < 0:
        ap.error(f"--loader-workers must be >= 0, got {args.loader_workers}")

    torch.set_num_threads(1)
    kept = make_process(args.model, args.compile)
    loader = make_loader(args.loader_workers) if args.loader_workers else None
    # One Checkpointer for every round: each restore takes the rank the round gave. A
    # data-parallel model is the same on every rank (checked after each restore); a sharded
    # one is not.
    ckpt = elasticd.Checkpointer(every=1, replicated=() if args.model == "fsdp" else ("model",))
    first_rank: list[int] = []
    done = [0]
    out = open(os.path.join(args.log, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)

    @elasticd.in_process(timeout=30)
    def train(r: elasticd.Round) -> None:
        if not first_rank:
            first_rank.append(r.rank)
        state, net = make_round(args.model, kept, args.compile)
        step = ckpt.restore(state)  # every round, on every rank: the step they all resume at
        times = dict(r.times, **(ckpt.last_restore.times if ckpt.last_restore else {}),
                     restored=time.time()) if r.times else {}
        # A restore that loaded a step checked the replicas equal on every rank ("model" is
        # replicated): DDP's broadcast of rank 0's parameters would copy the same bytes, one
        # collective more on every re-formation. Nothing loaded (a fresh start): DDP syncs.
        loaded = ckpt.last_restore is not None and ckpt.last_restore.source != "none"
        net = DDP(kept["inner"], init_sync=not loaded) if net is None else net
        opt = state["optim"]
        if times:
            times["ddp_built"] = time.time()
        inputs = None
        if loader is not None:  # the round's keys, from its step and rank; the same worker processes
            loader[1].start, loader[1].rank = step, r.rank
            inputs = iter(loader[0])
        try:
            while step < args.steps:
                r.check()
                x = batch(step, r.rank) if inputs is None else next(inputs)
                loss = net(x).pow(2).mean()
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

    time.sleep(args.setup_seconds)
    # Ready: imports done, the model built; next the script asks for its round. (A newcomer's
    # staged workers get here before their node joins one: the chaos test reads this moment.)
    with open(os.path.join(args.log, f"ready-{os.getpid()}.json"), "w") as fh:
        json.dump({"pid": os.getpid(), "t": time.time()}, fh)
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

"""examples/train_in_process.py ``--loader-workers``: the job bench_recovery's compiled
benchmark runs (issue 31) draws its input through a DataLoader with worker processes, started
before the first round, that every later round re-enters at its own step and rank.

What the benchmark's figure rests on, checked with real loader worker processes: each round's
iterator serves exactly :func:`batch`'s tensors from the round's step for the round's rank (the
losses stay those of the bare job), and a new round's iterator keeps the worker processes the
first one started (what an in-process survivor does not pay again). Fails on the code before
it: the example had no loader."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import train_in_process as example  # noqa: E402


def _pids(loader: torch.utils.data.DataLoader) -> list[int]:
    return [w.pid for w in loader._iterator._workers]


def test_each_round_reenters_the_loader_at_its_step_and_rank_with_the_same_workers():
    loader, keys = example.make_loader(2)
    try:
        started = _pids(loader)
        assert len(started) == 2 and os.getpid() not in started
        for start, rank in ((0, 0), (17, 5), (9, 2)):  # a first round, a shrink, a step back
            keys.start, keys.rank = start, rank
            inputs = iter(loader)
            for step in range(start, start + 3):
                assert torch.equal(next(inputs), example.batch(step, rank)), (step, rank)
            assert _pids(loader) == started  # persistent: no new worker process
    finally:
        loader._iterator._shutdown_workers()

"""ElasticSampler: every sample of an epoch exactly once, across a restart with a new world size.

Ranks are simulated without a process group by passing rank and world size explicitly; the
ranks draw batches in lockstep, as DDP training does.
"""

from __future__ import annotations

import pytest
import torch

from elasticd.checkpoint.sampler import ElasticSampler


def run(samplers, batch, rounds=None):
    """Draws ``batch`` indices per rank per round, in lockstep; returns what each rank saw."""
    iters = [iter(s) for s in samplers]
    seen = [[] for _ in samplers]
    n = 0
    while rounds is None or n < rounds:
        progressed = False
        for its, out in zip(iters, seen):
            for _ in range(batch):
                try:
                    out.append(next(its))
                    progressed = True
                except StopIteration:
                    break
        if not progressed:
            break
        n += 1
    return seen


@pytest.mark.parametrize("n", [30, 31, 37])
def test_exactly_once_across_resume_from_3_to_2_ranks(n):
    before = [ElasticSampler(n, seed=4, rank=r, world_size=3) for r in range(3)]
    for s in before:
        s.set_epoch(2)
    first = run(before, batch=2, rounds=3)  # 3 steps of 2 samples on each of 3 ranks
    state = before[0].state_dict()
    assert state["consumed"] == 18 and all(s.state_dict() == state for s in before)

    after = [ElasticSampler(n, seed=4, rank=r, world_size=2) for r in range(2)]
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(2)  # the training loop calls it again after restore: position kept
    second = run(after, batch=2)
    everything = [i for rank in first + second for i in rank]
    assert sorted(everything) == list(range(n))  # each sample once, none missing
    assert all(s.state_dict()["consumed"] == n for s in after)
    # The epoch's order is the same permutation, whatever the world size.
    g = torch.Generator()
    g.manual_seed(4 + 2)
    perm = torch.randperm(n, generator=g).tolist()
    assert set(first[0]) | set(first[1]) | set(first[2]) == set(perm[:18])


def test_uninterrupted_epoch_splits_the_permutation_by_rank():
    samplers = [ElasticSampler(10, shuffle=False, rank=r, world_size=3) for r in range(3)]
    assert [len(s) for s in samplers] == [4, 3, 3]
    assert [list(s) for s in samplers] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_drop_last_gives_every_rank_the_same_count():
    samplers = [ElasticSampler(10, drop_last=True, rank=r, world_size=3) for r in range(3)]
    seen = [list(s) for s in samplers]
    assert [len(x) for x in seen] == [3, 3, 3]
    assert len(set(sum(seen, []))) == 9


def test_manual_advance_is_exact_when_the_loader_prefetches():
    s = ElasticSampler(20, rank=0, world_size=2)
    it = iter(s)
    drawn = [next(it) for _ in range(6)]  # a prefetching loader ran ahead
    s.advance(4)  # but the job trained on 2 batches of 1 sample per rank
    assert s.state_dict()["consumed"] == 4
    next(it)
    assert s.state_dict()["consumed"] == 4  # automatic counting is off now
    resumed = ElasticSampler(20, rank=0, world_size=2)
    resumed.load_state_dict(s.state_dict())
    assert list(resumed)[0] not in drawn[:2]


def test_set_epoch_resets_position_and_permutation_changes():
    s = ElasticSampler(50, seed=1, rank=0, world_size=1)
    run([s], batch=5, rounds=2)
    assert s.consumed == 10
    s.set_epoch(0)
    assert s.consumed == 10
    first = list(ElasticSampler(50, seed=1, rank=0, world_size=1))
    s.set_epoch(1)
    assert s.consumed == 0 and list(s) != first


def test_state_of_another_dataset_is_refused():
    s = ElasticSampler(50, seed=1)
    with pytest.raises(ValueError, match="dataset_len"):
        s.load_state_dict(ElasticSampler(51, seed=1).state_dict())
    with pytest.raises(ValueError, match="rank 2 outside"):
        list(ElasticSampler(5, rank=2, world_size=2))


def test_works_with_a_dataloader():
    data = torch.arange(12).float()
    s = ElasticSampler(12, rank=1, world_size=2, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=s)
    it = iter(loader)
    next(it)
    assert s.state_dict()["consumed"] == 4  # one batch of 2 on each of 2 ranks

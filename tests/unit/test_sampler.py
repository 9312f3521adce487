"""ElasticSampler against torch's DistributedSampler, pattern by pattern, and exactly once across
restores at another world size.

Ranks are simulated without a process group by passing rank and world size explicitly; they
draw batches in lockstep, as DDP training does. Each pattern's test either matches
DistributedSampler's indices (same seed, world size, epoch) or asserts the documented difference.
"""

from __future__ import annotations

import collections
import logging
import tempfile
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from elasticd.worker.sampler import ElasticSampler


@pytest.fixture(autouse=True)
def _workers_tmp(tmp_path, monkeypatch):
    """DataLoader workers that the loader's teardown terminates skip multiprocessing's removal
    of their pymp-* directory (it was left in /tmp, failing .ci/test's check): they inherit
    tempfile's choice at fork, so theirs goes under tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

SIZES = [(n, w) for n in (1, 7, 12, 31, 37) for w in (1, 2, 3, 5)]  # 31, 37: prime lengths


class Data(torch.utils.data.Dataset):
    """Item i is i (so batches show their sample ids)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def reference(n, world, epoch=0, **kw):
    """DistributedSampler's indices for every rank at ``epoch``."""
    out = []
    for r in range(world):
        d = DistributedSampler(Data(n), num_replicas=world, rank=r, **kw)
        d.set_epoch(epoch)
        out.append(list(d))
    return out


def samplers(n, world, **kw):
    return [ElasticSampler(Data(n), num_replicas=world, rank=r, **kw) for r in range(world)]


def permutation(n, seed, epoch):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


class Job:
    """One DataLoader per simulated rank, stepped in lockstep like DDP ranks."""

    def __init__(self, ss, batch, **loader_kw):
        self.ss = ss
        self.loaders = [DataLoader(Data(s.dataset_len), batch_size=batch, sampler=s, **loader_kw)
                        for s in ss]
        self.iters = None

    def start(self):
        self.iters = [iter(dl) for dl in self.loaders]

    def step(self):
        """One batch on every rank; None when the ranks' loaders are done."""
        got = []
        for it in self.iters:
            try:
                got.append(next(it).tolist())
            except StopIteration:
                got.append(None)
        if all(g is None for g in got):
            return None
        assert None not in got, f"ranks ran out of batches at different steps: {got}"
        return got

    def states(self):
        states = [s.state_dict() for s in self.ss]
        assert all(st == states[0] for st in states), f"ranks disagree: {states}"
        return states[0]


# -- the patterns DistributedSampler supports ---------------------------------------------

@pytest.mark.parametrize("n,world", SIZES)
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterating_before_set_epoch_matches(n, world, shuffle, drop_last):
    got = [list(s) for s in samplers(n, world, shuffle=shuffle, drop_last=drop_last, seed=3)]
    assert got == reference(n, world, shuffle=shuffle, drop_last=drop_last, seed=3)


@pytest.mark.parametrize("n,world", SIZES)
@pytest.mark.parametrize("drop_last", [False, True])
def test_set_epoch_per_epoch_and_len_match(n, world, drop_last):
    ss = samplers(n, world, seed=11, drop_last=drop_last)
    for epoch in range(4):
        ref = reference(n, world, epoch, seed=11, drop_last=drop_last)
        for s in ss:
            s.set_epoch(epoch)
        assert [len(s) for s in ss] == [len(r) for r in ref]
        assert [list(s) for s in ss] == ref
        assert all(s.consumed == n for s in ss)


@pytest.mark.parametrize("n,world", [(31, 3), (12, 5), (37, 2)])
def test_iterating_twice_in_an_epoch_matches(n, world):
    """Twice in full, and a partial pass then a full one: both serve the epoch as
    DistributedSampler does (the second full pass repeats it, like DistributedSampler)."""
    ss = samplers(n, world, seed=2)
    for s in ss:
        s.set_epoch(1)
    ref = reference(n, world, 1, seed=2)
    assert [list(s) for s in ss] == ref
    assert [list(s) for s in ss] == ref  # the same order again
    partial = [next(iter(s)) for s in ss]
    assert partial == [r[0] for r in ref]
    assert [list(s) for s in ss] == ref


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_seed_and_shuffle_match(seed):
    for shuffle in (True, False):
        ss = samplers(37, 3, seed=seed, shuffle=shuffle)
        for s in ss:
            s.set_epoch(5)
        assert [list(s) for s in ss] == reference(37, 3, 5, seed=seed, shuffle=shuffle)
    assert list(samplers(37, 1, seed=seed)[0]) != list(samplers(37, 1, seed=seed + 1)[0])


def test_dataset_or_length_and_distributed_sampler_keywords():
    by_len = ElasticSampler(31, world_size=3, rank=2, seed=4)
    by_data = ElasticSampler(Data(31), 3, 2, True, 4)  # DistributedSampler's positional order
    assert list(by_len) == list(by_data) == reference(31, 3, seed=4)[2]
    with pytest.raises(ValueError, match="differ"):
        ElasticSampler(5, num_replicas=2, world_size=3)
    with pytest.raises(TypeError, match="len"):
        ElasticSampler(object())


@pytest.mark.parametrize("n,world", [(31, 3), (37, 5), (30, 3)])
def test_pad_false_difference_no_repeat_and_a_short_last_round(n, world):
    """The documented difference: without padding each rank's indices are
    DistributedSampler's minus its padded tail, and the epoch is each sample exactly once."""
    got = [list(s) for s in samplers(n, world, seed=1, pad=False)]
    ref = reference(n, world, seed=1)
    assert all(g == r[: len(g)] for g, r in zip(got, ref))
    assert sorted(i for g in got for i in g) == list(range(n))
    assert max(map(len, got)) - min(map(len, got)) == (1 if n % world else 0)


@pytest.mark.parametrize("workers", [0, 2])
def test_tutorial_probe_before_set_epoch_matches_over_epochs(workers):
    """The pytorch/examples Trainer: ``len(next(iter(loader))[0])`` and ``len(loader)``
    before ``set_epoch``, then the loop. The loop trains DistributedSampler's epoch (the
    probe's batch included); the probe advances nothing, and no epoch boundary runs dry."""
    n, world, batch = 37, 3, 4
    ss = samplers(n, world, seed=7)
    job = Job(ss, batch, num_workers=workers)
    for epoch in range(3):
        for dl in job.loaders:
            assert len(next(iter(dl))) == batch  # the probe (epoch-1's order, as with DS)
            assert len(dl) == -(-len(reference(n, world, 0)[0]) // batch)
        for s in ss:
            s.set_epoch(epoch)
        job.start()
        trained = [[] for _ in range(world)]
        while (b := job.step()) is not None:
            for r, ids in enumerate(b):
                trained[r] += ids
            job.states()
        assert trained == reference(n, world, epoch, seed=7)
        assert job.states()["consumed"] == n


# -- the position: what was trained, not what was drawn -----------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_position_counts_batches_returned_not_prefetched(workers):
    s = ElasticSampler(40, rank=1, world_size=2, seed=3)
    dl = DataLoader(Data(40), batch_size=2, sampler=s, num_workers=workers, prefetch_factor=4
                    if workers else None)
    it = iter(dl)
    for k in range(1, 4):
        next(it)
        assert s.state_dict()["consumed"] == k * 2 * 2  # k batches of 2 on each of 2 ranks
    first = iter(dl)  # a probe: abandoned after one batch
    next(first)
    del first
    next(it)  # the loop goes on
    assert s.consumed == 16


@pytest.mark.parametrize("workers", [0, 2])
def test_position_follows_the_iterator_the_loop_draws_from(workers):
    """A warm-up that draws 3 batches and is abandoned, then the loop: the position is the
    loop's (not the warm-up's). A probe inside the loop: the loop's position is kept."""
    s = ElasticSampler(40, rank=0, world_size=2, seed=3)
    dl = DataLoader(Data(40), batch_size=2, sampler=s, num_workers=workers)
    warm = iter(dl)
    for _ in range(3):
        next(warm)
    loop = iter(dl)
    next(loop)
    assert s.state_dict()["consumed"] == 4  # 1 batch of 2 on 2 ranks, not 3
    gone = weakref.ref(warm)
    del warm
    assert gone() is None  # freed at once (its workers shut down): the sampler holds none
    next(loop)
    assert next(iter(dl)).tolist() == reference(40, 2, seed=3)[0][:2]  # probe: epoch start
    third = next(loop)
    assert third.tolist() == reference(40, 2, seed=3)[0][4:6]
    assert s.state_dict()["consumed"] == 12


def test_a_new_iterator_every_step_does_not_pile_up():
    s = ElasticSampler(1000, rank=0, world_size=1)
    dl = DataLoader(Data(1000), batch_size=10, sampler=s)
    for _ in range(50):
        next(iter(dl))  # the same first batch each time, as with DistributedSampler
    assert s.consumed == 10


def test_persistent_workers_and_loader_drop_last_reach_the_epoch_end():
    s = ElasticSampler(23, rank=0, world_size=2, seed=1)
    dl = DataLoader(Data(23), batch_size=5, sampler=s, num_workers=2, persistent_workers=True,
                    drop_last=True)
    for epoch in range(3):
        s.set_epoch(epoch)
        got = [i for b in dl for i in b.tolist()]
        assert got == reference(23, 2, epoch, seed=1)[0][:10]  # 12 drawn, 2 full batches
        assert s.consumed == 23  # the loader's dropped tail goes with the epoch's end


def test_batch_size_none_counts_items():
    s = ElasticSampler(9, rank=0, world_size=1, seed=0)
    it = iter(DataLoader(Data(9), batch_size=None, sampler=s, num_workers=2))
    next(it), next(it)
    assert s.consumed == 2


# -- exactly once across restores ---------------------------------------------------------

def run_kept(n, worlds, stops, batch, seed=4, epoch=2, workers=0, pad=True):
    """Trains one epoch over a sequence of worker groups of ``worlds[i]`` ranks, each stopped
    after ``stops[i]`` steps (None: to the end) and restored by the next from rank 0's state.
    Returns the samples trained, the restore points, and the last world."""
    state, trained = None, []
    for world, stop in zip(worlds, stops):
        ss = samplers(n, world, seed=seed, pad=pad)
        job = Job(ss, batch, num_workers=workers)
        for s in ss:
            if state is not None:
                s.load_state_dict(state)
            s.set_epoch(epoch)  # the loop calls it again after the restore: position kept
        job.start()
        steps = 0
        while (stop is None or steps < stop) and (b := job.step()) is not None:
            trained += [i for ids in b for i in ids]
            steps += 1
            state = job.states()
    return trained, state


def assert_once(trained, n, seed, epoch, world, pad=True):
    """Every sample once; with padding, the only repeats are DistributedSampler's: the
    epoch's first samples, fewer than the last world size."""
    counts = collections.Counter(trained)
    assert set(counts) == set(range(n)), f"never trained: {set(range(n)) - set(counts)}"
    twice = {i for i, c in counts.items() if c > 1}
    assert max(counts.values()) <= 2
    order = permutation(n, seed, epoch)
    allowed = set(order[: world - 1]) if pad else set()
    assert twice <= allowed and len(twice) < max(world, 1), f"repeated: {twice}"


@pytest.mark.parametrize("n", [30, 31, 37])
@pytest.mark.parametrize("workers", [0, 2])
def test_exactly_once_across_resume_from_3_to_2_ranks(n, workers):
    trained, state = run_kept(n, [3, 2], [3, None], batch=2, workers=workers)
    assert state["consumed"] == n
    assert_once(trained, n, 4, 2, world=2)
    # The first group's 3 steps are the permutation's first 18 samples, whatever the world.
    assert set(trained[:18]) == set(permutation(n, 4, 2)[:18])


@pytest.mark.parametrize("n", [31, 37])
def test_exactly_once_without_padding_across_2_to_3_to_1(n):
    trained, _ = run_kept(n, [2, 3, 1], [2, 1, None], batch=3, pad=False)
    assert sorted(trained) == list(range(n))


def test_restored_at_the_epoch_end_tutorial_probe_then_next_epoch():
    """Saved at the last step of epoch 0, restored, the Trainer re-enters epoch 0: its probe
    gets a batch, set_epoch(0) keeps the restored end, the loop trains nothing, and epoch 1
    is DistributedSampler's."""
    n, world = 31, 3
    trained, state = run_kept(n, [3], [None], batch=4, epoch=0)
    assert state == {"epoch": 0, "consumed": n, "seed": 4, "dataset_len": n, "shuffle": True,
                     "split": ""}
    ss = samplers(n, world, seed=4)
    job = Job(ss, 4)
    for epoch in (0, 1):
        for s in ss:
            s.load_state_dict(state) if epoch == 0 else None
        for dl in job.loaders:
            assert len(next(iter(dl))) == 4  # the probe: no StopIteration
        for s in ss:
            s.set_epoch(epoch)
        job.start()
        got = []
        while (b := job.step()) is not None:
            got.append(b)
        assert len(got) == (0 if epoch == 0 else 3)
    assert [s.consumed for s in ss] == [n] * world


def test_restored_at_the_epoch_end_without_set_epoch_warns_that_it_repeats(caplog):
    ss = samplers(12, 2, seed=0)
    for s in ss:
        s.load_state_dict({"epoch": 3, "consumed": 12})
    job = Job(ss, 2)
    job.start()
    assert job.step() == [r[:2] for r in reference(12, 2, 3)]  # epoch 3 again, as DS serves
    with caplog.at_level(logging.WARNING):
        job.states()
    assert "trains epoch 3 again" in caplog.text


def test_set_epoch_with_a_constant_epoch_repeats_it_like_distributed_sampler():
    s = ElasticSampler(10, rank=0, world_size=1, seed=9)
    for _ in range(3):
        s.set_epoch(0)
        assert list(s) == reference(10, 1, 0, seed=9)[0]


def test_restored_mid_epoch_probe_and_len_serve_the_rest():
    """After a mid-epoch restore len() is the rest (DistributedSampler's stays the full
    share: the documented difference) and a probe before set_epoch moves nothing."""
    ss = samplers(40, 2, seed=1)
    for s in ss:
        s.load_state_dict({"epoch": 1, "consumed": 16})
    order = permutation(40, 1, 1)
    assert [len(s) for s in ss] == [12, 12]
    job = Job(ss, 3)
    for dl in job.loaders:
        next(iter(dl))
    for s in ss:
        s.set_epoch(1)
    job.start()
    first = job.step()
    assert first == [order[16:22][0::2], order[16:22][1::2]]
    assert job.states()["consumed"] == 22


def test_set_epoch_back_from_a_restored_epoch_warns(caplog):
    s = ElasticSampler(10)
    s.load_state_dict({"epoch": 4, "consumed": 3})
    with caplog.at_level(logging.WARNING):
        s.set_epoch(0)
    assert "trained again" in caplog.text and s.consumed == 0


def test_state_of_another_dataset_is_refused():
    s = ElasticSampler(50, seed=1)
    with pytest.raises(ValueError, match="dataset_len"):
        s.load_state_dict(ElasticSampler(51, seed=1).state_dict())
    with pytest.raises(ValueError, match="rank 2 outside"):
        list(ElasticSampler(5, rank=2, world_size=2))


def test_a_restore_into_another_random_split_warns_how_to_seed_it(caplog):
    """minGPT splits its dataset with an unseeded random_split: after a restart the training
    split holds other samples, and the restored position no longer means every sample once."""
    from torch.utils.data import random_split

    data = list(range(100))
    first, _ = random_split(data, [80, 20], generator=torch.Generator().manual_seed(1))
    again, _ = random_split(data, [80, 20], generator=torch.Generator().manual_seed(2))
    saved = ElasticSampler(first).state_dict()
    with caplog.at_level(logging.WARNING):
        ElasticSampler(again).load_state_dict(saved)
    assert "other samples" in caplog.text and "manual_seed" in caplog.text
    caplog.clear()
    seeded, _ = random_split(data, [80, 20], generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING):
        ElasticSampler(seeded).load_state_dict(saved)  # the same split: nothing to say
        ElasticSampler(80).load_state_dict(saved)  # a length: nothing to check
        ElasticSampler(again).load_state_dict({**saved, "split": ""})  # an old snapshot
    assert caplog.text == ""
    assert ElasticSampler(data).split == "" and len(ElasticSampler(first).split) == 16

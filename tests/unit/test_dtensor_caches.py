"""DTensor's caches, emptied at a leave (elasticd/worker/dtensor_caches.py, issue 31): a
process's first FSDP2 round's group is kept alive by them until they are, and released once
they are (the gloo group and its store: the sockets the in-process leave checks). One process,
world 1, gloo on a FileStore; bench/spikes/inprocess/fsdp_first_round.py shows the sockets.
Before, the group stayed alive through either of elasticd's own holds: its layout caches
(elasticd/worker/shards.py) and the flatten memo's strong reference to each DTensor's spec."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

from elasticd.worker import dtensor_caches
from elasticd.worker.snapshot_plan import Planner


def _fsdp_round(path: str, planner: Planner) -> weakref.ref:
    """One round: a group, a 2-layer model under ``fully_shard``, an optimizer step and two
    saves' flattens (``planner``: a Checkpointer's, kept across rounds: its memo), then the
    group destroyed and every reference to them dropped; returns the group's weak ref."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    try:
        group = weakref.ref(dist.group.WORLD)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        for _ in range(2):  # the second one through the memo
            planner.flatten({"model": model, "optim": opt})
        del model, opt, layer
    finally:
        dist.destroy_process_group()
    return group


@pytest.fixture
def clean_caches():
    dtensor_caches.forget()  # what earlier tests of this process cached is not this test's
    yield
    dtensor_caches.forget()


def test_a_first_fsdp2_rounds_group_is_kept_by_dtensors_caches_until_they_are_emptied(
        tmp_path, clean_caches):
    planner = Planner("job")
    group = _fsdp_round(str(tmp_path / "store"), planner)
    gc.collect()
    # torch 2.13: alive, through cached specs of its mesh (a torch that stops it: this
    # module is no longer needed, and the assertion says so).
    assert group() is not None
    assert dtensor_caches.forget() == 5  # and elasticd's layout caches
    gc.collect()
    assert group() is None  # the planner's memo, kept, holds no spec of it either


def test_nothing_is_imported_or_emptied_in_a_process_without_dtensor(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.distributed.tensor", raising=False)
    assert dtensor_caches.forget() == 0
    assert "torch.distributed.tensor" not in sys.modules

"""DTensor's caches, emptied at a leave (elasticd/worker/dtensor_caches.py, issue 31): a
process's first FSDP2 round's group is kept alive by them until they are, and released once
they are (the gloo group and its store: the sockets the in-process leave checks). One process,
world 1, gloo on a FileStore; bench/spikes/inprocess/fsdp_first_round.py shows the sockets."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

from elasticd.worker import dtensor_caches


def _fsdp_round(path: str) -> weakref.ref:
    """One round: a group, a 2-layer model under ``fully_shard`` and an optimizer step, then
    the group destroyed and every reference to them dropped; returns the group's weak ref."""
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
    group = _fsdp_round(str(tmp_path / "store"))
    gc.collect()
    # torch 2.13: alive, through cached specs of its mesh (a torch that stops it: this
    # module is no longer needed, and the assertion says so).
    assert group() is not None
    assert dtensor_caches.forget() == 5
    gc.collect()
    assert group() is None


def test_nothing_is_imported_or_emptied_in_a_process_without_dtensor(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.distributed.tensor", raising=False)
    assert dtensor_caches.forget() == 0
    assert "torch.distributed.tensor" not in sys.modules

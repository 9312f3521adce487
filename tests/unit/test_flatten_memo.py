"""flatten's memo: the same result as a fresh flatten at every step, whatever changed.

The Checkpointer keeps a memo between saves so that a state whose tensor dicts are the same
objects over the same memory is not encoded again (the training thread's stall). These tests
compare, step after step and after each kind of change a script or FSDP2 can make, the memo's
result with a flatten that has none, and check that the memo was used where nothing changed.
"""

from __future__ import annotations

import gc
import json
import shutil
import uuid
import weakref

import pytest
import torch
import torch.distributed as dist

from elasticd.testing.transport import InProcessTransport
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.worker.checkpointer import Checkpointer
from elasticd.worker.state import flatten, load_into

torch.set_num_threads(1)


def make(opt: str = "adam"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.Linear(7, 3))
    if opt == "sgd":  # momentum_buffer is None until the first step
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
    return {"model": model, "optim": optim, "step": 0}


def step(state) -> None:
    state["model"](torch.randn(4, 5)).square().mean().backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["step"] += 1


def same_as_fresh(state, memo):
    """The memo's flatten, checked against a fresh one: meta, names, key and tensors."""
    got, fresh = flatten(state, memo), flatten(state)
    assert json.dumps(got.meta) == json.dumps(fresh.meta)
    assert got.names == fresh.names
    assert got.key() == fresh.key()
    for a, b in zip(got.tensors, fresh.tensors, strict=True):
        assert (a.data_ptr(), a.shape, a.dtype, a.requires_grad) == \
            (b.data_ptr(), b.shape, b.dtype, b.requires_grad)
    return got


def node(flat, key):
    return next(n for k, _, n in flat.meta["objects"] if k == key)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_the_memo_gives_a_fresh_flattens_result_and_is_used_while_nothing_changes(opt):
    state, memo = make(opt), {}
    first = same_as_fresh(state, memo)
    for _ in range(3):
        step(state)
        again = same_as_fresh(state, memo)
        assert node(again, "model") is node(first, "model")  # reused, not encoded again
        first = again
    # The optimizer's per-parameter state: reused from the second step on (the first created
    # it, and SGD's momentum buffers replace None at the first step).
    optim_state = node(again, "optim")["v"][0]
    step(state)
    assert node(same_as_fresh(state, memo), "optim")["v"][0] is optim_state
    assert set(memo) == {"model", "optim/state"}


def test_the_memo_sees_every_change_to_what_it_recorded():
    state, memo = make(), {}
    step(state)
    same_as_fresh(state, memo)
    model, optim = state["model"], state["optim"]
    weight = model[0].weight
    changes = [
        lambda: setattr(weight, "data", torch.randn(7, 5)),  # same object, other memory
        lambda: setattr(weight, "data", torch.randn(9, 5)),  # and another shape
        lambda: setattr(weight, "data", weight.data.double()),  # and another dtype
        lambda: weight.requires_grad_(False),  # kept as itself, no detach
        lambda: optim.state[model[2].bias].__setitem__("exp_avg", torch.zeros(3)),
        lambda: optim.state[model[2].bias].pop("exp_avg_sq"),
        lambda: model.register_buffer("extra", torch.ones(2)),
        lambda: model[1].register_buffer("running_mean", torch.zeros(7)),  # a new object
        lambda: setattr(model, "0", torch.nn.Linear(5, 7)),  # a new module, same names
        lambda: setattr(model[2], "_version", 7),  # the same tensors, other module metadata
    ]
    for change in changes:
        before = flatten(state, memo)
        change()
        after = same_as_fresh(state, memo)
        assert after.key() != before.key() or [id(t) for t in after.tensors] != \
            [id(t) for t in before.tensors] or any(
                a.data_ptr() != b.data_ptr() for a, b in zip(after.tensors, before.tensors))


def test_a_name_that_collides_with_a_nested_path_is_never_reused_wrongly():
    # "m/w" as a top-level key and the module "m"'s parameter "w" name the same path: the
    # second one is renamed "~2", which depends on what came before it.
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.ones(2))
    memo = {}
    for state in ({"m/w": torch.zeros(1), "m": module}, {"x": torch.zeros(1), "m": module},
                  {"m/w": torch.zeros(1), "m": module}):
        same_as_fresh(state, memo)


def test_the_memo_keeps_no_dropped_model_alive():
    state, memo = make(), {}
    step(state)
    flatten(state, memo)
    flatten(state, memo)
    ref = weakref.ref(state["model"][0].weight)
    del state
    gc.collect()
    assert ref() is None and memo


def test_fsdp2_dtensors_reused_until_their_local_tensor_or_spec_changes():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        state, memo = {"model": model, "optim": torch.optim.Adam(model.parameters()),
                       "step": 0}, {}
        step(state)
        first = same_as_fresh(state, memo)
        step(state)
        assert node(same_as_fresh(state, memo), "model") is node(first, "model")
        weight = model[0].weight
        # What FSDP2's reset_sharded_param does: a new local tensor under the same DTensor.
        weight._local_tensor = weight._local_tensor.clone()
        flat = same_as_fresh(state, memo)
        assert flat.tensors[0] is weight._local_tensor
        # Another layout over the same local tensor (a one-rank mesh: replicated or sharded
        # hold the same rows): the saved placements follow.
        weight._spec = DTensorSpec(weight._spec.mesh, (Replicate(),),
                                   tensor_meta=weight._spec.tensor_meta)
        flat = same_as_fresh(state, memo)
        assert node(flat, "model")["v"][0]["placements"] == ["R"]
        # A restore from the memo's flatten loads the live values.
        saved = [t.clone() for t in flat.tensors]
        step(state)
        load_into(state, saved, flat.meta)
        assert torch.equal(weight._local_tensor, saved[0])
    finally:
        dist.destroy_process_group()


def test_a_checkpointers_header_takes_non_ascii_text_and_what_orjson_refuses():
    # Step 1's meta goes through orjson (UTF-8 text as it is), step 2's through the json
    # fallback (an int over 64 bits, which orjson refuses).
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    try:
        t = InProcessTransport(CheckpointService(store, "n1").handlers())
        state = make()
        state["note"], state["big"] = "été ✓", 1
        with Checkpointer(transport=t, job="j", rank=0, world_size=1) as ckpt:
            for n, big in ((1, 1), (2, 2**70)):
                step(state)
                state["big"] = big
                assert ckpt.save(n, state) is True
                ckpt.wait()
                fresh = make()
                fresh["note"], fresh["big"] = "", 0
                with Checkpointer(transport=t, job="j", rank=0, world_size=1) as again:
                    assert again.restore(fresh) == n
                assert (fresh["note"], fresh["big"]) == ("été ✓", big)
                assert torch.equal(fresh["model"][0].weight, state["model"][0].weight)
            assert ckpt.stats["saves"] == 2 and ckpt.stats["failed"] == 0
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)

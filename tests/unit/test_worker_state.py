"""Worker-side state flattening: exact round trips through snapshot bytes, and exact resume.

The resume tests are the point: a model, optimizer, scheduler, sampler and RNG restored from a
snapshot must continue training bitwise equal to a run that was never interrupted.
"""

from __future__ import annotations

import collections
import math
import random
import shutil
import struct
import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist

from elasticd.worker.copier import CpuCopier, copy_into, read_tensors
from elasticd.snapshot.format import SnapshotHeader, seal
from elasticd.snapshot.reader import SnapshotReader
from elasticd.store.shm import SlotStore
from elasticd.testing.snapshot import load_snapshot
from elasticd.worker.rng_state import RNGState
from elasticd.worker.state import (
    META_VERSION,
    StateError,
    StateMismatch,
    UnsupportedValue,
    flatten,
    load_into,
)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # docs/facts.md: bitwise equality needs a fixed thread count
    try:
        yield
    finally:
        torch.set_num_threads(before)


def to_bytes(state, step=0) -> bytes:
    flat = flatten(state)
    lay = flat.layout("job", block_size=4096)
    buf = bytearray(lay.total_size)
    CpuCopier().start(flat.tensors, buf, lay).wait()
    seal(buf, SnapshotHeader("job", step, 0, 0, 1, lay, flat.meta))
    return bytes(buf)


def from_bytes(state, data: bytes) -> None:
    reader = SnapshotReader(data, job="job", rank=0, world_size=1)
    load_snapshot(state, data, reader.header)


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def same(a, b) -> bool:
    """Exact equality, including types, float bits, tensor dtypes and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return (list(a) == list(b) and all(same(a[k], b[k]) for k in a)
                and same(getattr(a, "_metadata", None), getattr(b, "_metadata", None)))
    return a == b


TENSORS = {
    "f32": torch.randn(3, 4),
    "bf16": torch.randn(5, 3).bfloat16(),
    "f16": torch.randn(7).half(),
    "f64_0dim": torch.tensor(3.25, dtype=torch.float64),
    "empty": torch.empty(0, 3),
    "transposed": torch.randn(4, 6).t(),
    "strided": torch.arange(40)[::3],
    "bool": torch.rand(9) > 0.5,
    "int8": torch.randint(-128, 127, (5,), dtype=torch.int8),
    "uint8": torch.randint(0, 255, (5,), dtype=torch.uint8),
    "int32": torch.randint(-(2**31), 2**31 - 1, (5,), dtype=torch.int32),
    "int64": torch.tensor([2**62, -1]),
    "c64": torch.randn(3, dtype=torch.complex64),
    "specials": torch.tensor([math.nan, -0.0, math.inf, -math.inf]),
    "fp8": torch.randn(6).to(torch.float8_e4m3fn),
}


def test_tensors_of_every_kind_round_trip_bitwise():
    assert not TENSORS["transposed"].is_contiguous()
    flat = flatten({"t": TENSORS})
    assert flat.names == [f"t/{k}" for k in TENSORS]
    data = to_bytes({"t": TENSORS})
    into: dict = {"t": None}
    load_into(into, read_tensors(data, SnapshotReader(data).header.layout), flat.meta)
    back = into["t"]
    for name, t in TENSORS.items():
        assert same(t, back[name]), name
        if name not in ("specials", "fp8"):
            assert torch.equal(t, back[name]), name


def test_plain_values_round_trip_exactly():
    values = {
        "epoch": 3, "big": 2**80, "lr": 0.1, "neg0": -0.0, "nan": math.nan, "inf": -math.inf,
        "flag": True, "none": None, "name": "rünning",
        "pair": (1, [2.5, (3,)]), "ints": {0: "a", 1: "b"}, "mixed": {None: 1, 2.5: 2, (1, 2): 3},
        "blob": b"\x00\xffpickle-free", "c": complex(1.5, -2.0),
        "od": collections.OrderedDict([("z", 1), ("a", 2)]),
        "arr": np.arange(6, dtype=np.uint32).reshape(2, 3), "arr0": np.array(2.5, np.float16),
        "arr_empty": np.zeros((0, 2), np.int16), "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "strided": np.arange(10)[::3], "readonly": np.frombuffer(b"abcd", np.uint8),
        "np_f32": np.float32(1.1), "np_i64": np.int64(-7), "np_bool": np.bool_(True),
        "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
    }
    state = dict(values)
    data = to_bytes(state)
    for key in state:
        state[key] = "overwritten"
    from_bytes(state, data)
    for key, value in values.items():
        assert same(value, state[key]), key


def test_unsupported_values_are_refused_with_their_path():
    with pytest.raises(UnsupportedValue, match="x/a/1: cannot snapshot a set"):
        flatten({"x": {"a": [1, {2}]}})
    with pytest.raises(UnsupportedValue, match="function"):
        flatten({"f": lambda: 1})
    with pytest.raises(UnsupportedValue, match="keys must be strings"):
        flatten({1: 2})
    with pytest.raises(UnsupportedValue, match="dense"):
        flatten({"s": torch.eye(3).to_sparse()})
    with pytest.raises(UnsupportedValue, match="object"):
        flatten({"o": np.array([object()])})


class Sampler:
    """A sampler-like object: an epoch, a position and its own generator."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.n, self.epoch, self.pos = n, 0, 0
        self.gen = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(n, generator=self.gen)

    def next_batch(self, size: int = 8) -> torch.Tensor:
        if self.pos + size > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = torch.randperm(self.n, generator=self.gen)
        self.pos += size
        return self.order[self.pos - size : self.pos]

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos, "order": self.order, "gen": self.gen.get_state()}

    def load_state_dict(self, sd) -> None:
        self.epoch, self.pos, self.order = sd["epoch"], sd["pos"], sd["order"].clone()
        self.gen.set_state(sd["gen"])


DATA_X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
DATA_Y = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))


def build(seed: int, opt: str):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    if opt == "sgd":
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.99))
        sched = torch.optim.lr_scheduler.ExponentialLR(optim, gamma=0.9)
    return {"model": model, "optim": optim, "sched": sched, "sampler": Sampler(seed=seed),
            "rng": RNGState(), "step": 0, "extras": {"losses": [], "best": math.inf}}


def train(state, steps: int) -> None:
    model, optim = state["model"], state["optim"]
    for _ in range(steps):
        idx = state["sampler"].next_batch()
        # Every generator matters: torch (noise, dropout), numpy and python random.
        x = DATA_X[idx] + torch.randn(len(idx), 8) * float(np.random.rand()) * random.random()
        optim.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), DATA_Y[idx])
        loss.backward()
        optim.step()
        state["sched"].step()
        state["step"] += 1
        state["extras"]["losses"].append(loss.item())
        state["extras"]["best"] = min(state["extras"]["best"], loss.item())


def fingerprint(state):
    return {
        "model": state["model"].state_dict(),
        "optim": state["optim"].state_dict(),
        "sched": state["sched"].state_dict(),
        "sampler": state["sampler"].state_dict(),
        "rng": RNGState().state_dict(),
        "step": state["step"],
        "extras": state["extras"],
    }


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_training_resumes_bitwise_equal_to_an_uninterrupted_run(opt):
    a = build(0, opt)
    train(a, 5)  # crosses an epoch of the sampler? no: 5 x 8 < 64; the resume part does
    data = to_bytes(a, step=a["step"])
    train(a, 6)
    expected = fingerprint(a)

    b = build(1, opt)  # other weights, other generator states
    np.random.seed(99)
    random.seed(99)
    from_bytes(b, data)
    assert b["step"] == 5 and len(b["extras"]["losses"]) == 5
    train(b, 6)
    got = fingerprint(b)
    assert same(expected, got)
    assert b["sampler"].epoch == 1
    for p, q in zip(a["model"].parameters(), b["model"].parameters()):
        assert torch.equal(p, q)


def test_state_through_the_slot_store_with_a_background_copy():
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    copier = CpuCopier(background=True)
    try:
        a = build(0, "adamw")
        train(a, 2)
        flat = flatten(a)
        lay = flat.layout("job")
        slot = store.reserve("job", 0, lay.total_size)
        copier.start(flat.tensors, slot.buffer, lay).wait(timeout=60)
        store.complete(slot, SnapshotHeader("job", 2, 0, 0, 1, lay, flat.meta))
        b = build(1, "adamw")
        view = store.latest("job", 0, pin=True, verify=True)
        load_snapshot(b, view.buffer, view.header)
        view.release()
        assert same(fingerprint(a), fingerprint(b))
    finally:
        copier.close()
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def test_zero_redundancy_shard_round_trip():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(6, 3)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.05)
        return {"model": model, "zero": zero,
                "sched": torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=0.5)}

    def steps(s, n):
        for _ in range(n):
            s["zero"].zero_grad()
            s["model"](DATA_X[:8, :6]).square().mean().backward()
            s["zero"].step()
            s["sched"].step()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        a = make(0)
        steps(a, 3)
        data = to_bytes(a)
        steps(a, 3)
        b = make(1)
        from_bytes(b, data)
        # The scheduler's lr lives in the wrapper's groups: restored, not reset to 0.05.
        assert b["zero"].param_groups[0]["lr"] == 0.05 * 0.5**3
        steps(b, 3)
        assert same(a["model"].state_dict(), b["model"].state_dict())
        assert same(a["zero"].optim.state_dict(), b["zero"].optim.state_dict())
    finally:
        dist.destroy_process_group()


def test_mismatched_snapshots_are_refused_with_the_key():
    a = build(0, "sgd")
    data = to_bytes(a)
    b = build(0, "sgd")
    del b["extras"]
    with pytest.raises(StateMismatch, match=r"\['extras'\] that the state lacks"):
        from_bytes(b, data)
    b = build(0, "sgd")
    b["model"] = torch.nn.Linear(3, 3)
    with pytest.raises(StateMismatch, match=r"state\['model'\].*refused"):
        from_bytes(b, data)
    b = build(0, "sgd")
    b["optim"], b["model"] = b["model"], b["optim"]
    with pytest.raises(StateMismatch, match=r"state\['model'\] is a SGD \(optimizer\)"):
        from_bytes(b, data)


def test_bad_meta_raises_state_errors():
    flat = flatten({"x": [torch.ones(2)]})
    with pytest.raises(StateMismatch, match="newer"):
        load_into({"x": 0}, flat.tensors, {**flat.meta, "v": META_VERSION + 1})
    with pytest.raises(StateError, match="out of range"):
        load_into({"x": 0}, [], flat.meta)
    with pytest.raises(StateError, match="malformed"):
        load_into({"x": 0}, flat.tensors, {"v": 1, "objects": [["x", "value"]]})
    with pytest.raises(StateError, match="not a plain numeric"):
        load_into({"x": 0}, [torch.zeros(8, dtype=torch.uint8)],
                  {"v": 1, "objects": [["x", "value", {"@": "ndarray", "i": 0, "dtype": "O",
                                                        "shape": [1]}]]})


def test_copier_checks_its_inputs():
    flat = flatten({"t": {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)}})
    lay = flat.layout("job")
    with pytest.raises(ValueError, match="2 entries"):
        copy_into(flat.tensors[:1], bytearray(lay.total_size), lay)
    with pytest.raises(ValueError, match="smaller"):
        copy_into(flat.tensors, bytearray(lay.total_size - 1), lay)
    with pytest.raises(ValueError, match="expects int64"):
        copy_into([flat.tensors[0], torch.zeros(2)], bytearray(lay.total_size), lay)
    with pytest.raises(ValueError, match="writable"):
        copy_into(flat.tensors, bytes(lay.total_size), lay)


def test_a_modules_parameters_are_flattened_without_their_grad():
    """A module's state is read with keep_vars (no detach() per parameter, which costs a
    dispatch per FSDP2 DTensor); what the copy gets is still detached from autograd, the same
    storage as the live parameter."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    flat = flatten({"model": model})
    by_name = dict(zip(flat.names, flat.tensors))
    weight = by_name["model/0.weight"]
    assert not weight.requires_grad and weight.grad_fn is None
    assert weight.data_ptr() == model[0].weight.data_ptr()
    assert all(not t.requires_grad for t in flat.tensors)


def test_a_module_whose_state_dict_takes_no_arguments_is_flattened():
    """A script's own ``state_dict(self)`` override is called as it is (keep_vars is only
    passed to torch's own method)."""

    class Custom(torch.nn.Linear):
        def state_dict(self):  # noqa: D102 — no keep_vars, no destination
            return {"w": self.weight.detach() * 2}

    model = Custom(2, 3)
    flat = flatten({"model": model})
    assert flat.names == ["model/w"]
    assert torch.equal(flat.tensors[0], model.weight.detach() * 2)


def test_an_optimizers_parameters_are_named_from_the_module_that_holds_them():
    """The meta names each optimizer parameter (in state_dict index order) after the module of
    the state holding them all, for the persistent tier's DCP keys; none where no module does."""
    ema = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam([{"params": [model[2].bias, model[0].weight]},
                            {"params": [model[0].bias], "lr": 0.1}])
    stray = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    state = {"ema": ema, "model": model, "optim": opt, "stray": stray}
    meta = flatten(state).meta
    assert meta["param_names"] == {"optim": ["2.bias", "0.weight", "0.bias"]}
    assert flatten(state).meta == meta  # the cached names, the same
    opt.add_param_group({"params": [model[2].weight]})  # a new group: named again
    assert flatten(state).meta["param_names"]["optim"][-1] == "2.weight"
    assert "param_names" not in flatten({"optim": opt}).meta  # no module to name them
    # The names are the tier's business: the snapshot restores as before.
    flat = flatten(state)
    load_into(state, [t.clone() for t in flat.tensors], flat.meta)

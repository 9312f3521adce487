"""Flattening a training state into named tensors plus JSON meta, and restoring it exactly.

A training script hands elasticd a dict such as ``{"model": model, "optim": opt, "sched": sched,
"sampler": sampler, "rng": RNGState(), "epoch": 3}``. :func:`flatten` turns it into an ordered list
of named tensors (``model/fc.weight``, ``optim/state/0/exp_avg``), which go into the snapshot's
payload as raw bytes, and a JSON meta tree recording everything else: which object each top-level
entry is, the structure of its state dict, and every non-tensor leaf with its exact Python type
(tuple vs list, int dict keys, non-finite floats, numpy scalars and arrays). :func:`load_into`
restores every object bitwise from the tensors and the meta. No pickle anywhere: a snapshot may
come from a peer, and JSON cannot run code.

Supported values: ``nn.Module`` (its state_dict, with the per-module version metadata), any
``torch.optim.Optimizer``, ``ZeroRedundancyOptimizer`` (this rank's local shard plus the
wrapper's param-group hyper-parameters, which its ``step`` copies over the shard's, and the
partition map that lets another world size reshard it, docs/facts.md),
anything with ``state_dict``/``load_state_dict`` (LR schedulers, samplers, :class:`RNGState`),
and plain values. Worker side: imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import sys
import weakref
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import numpy as np
import torch

from elasticd.worker import shards
from elasticd.worker.slot_rows import RowCopy, SlotFiles
from elasticd.worker.state_memo import DictMemo, depth, tensor_key
from elasticd.worker.copier import dtype_name, spec_of
from elasticd.snapshot.format import DEFAULT_BLOCK_SIZE, Layout, layout
from elasticd.errors import CheckpointError

META_VERSION = 1
_NUMPY_KINDS = "biufc"  # numpy values whose bytes alone define them


class StateError(CheckpointError):
    """Base class: a state could not be flattened or restored."""


class UnsupportedValue(StateError, TypeError):
    """A value in the state has no exact, pickle-free representation."""


class StateMismatch(StateError):
    """The snapshot does not fit the state it is loaded into (keys, kinds, shapes, version)."""


def _zero_class() -> type | None:
    # Importing torch.distributed.optim costs ~1 s (it scripts functional optimizers); a state
    # can only hold a ZeroRedundancyOptimizer if the script has imported it already.
    module = sys.modules.get("torch.distributed.optim")
    return getattr(module, "ZeroRedundancyOptimizer", None)


def _kind(value: Any) -> str:
    if isinstance(value, torch.nn.Module):
        return "module"
    zero = _zero_class()
    if zero is not None and isinstance(value, zero):
        return "zero"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "stateful"
    return "value"


def _state_of(kind: str, value: Any) -> Any:
    if kind == "zero":
        # The shard holds this rank's optimizer state; the wrapper's groups hold the lr etc.
        # that zero.step() copies onto the shard, and that a scheduler has been changing.
        # "global": each local parameter's index in the global (consolidated) state, the
        # partition map a rank of another world size needs to find its parameters' state.
        index = value._param_to_index
        return {"shard": value.optim.state_dict(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in value.param_groups],
                "global": [index[p] for g in value.optim.param_groups for p in g["params"]]}
    if kind == "module" and type(value).state_dict is torch.nn.Module.state_dict:
        # keep_vars: the parameters themselves, not a detach() each, which costs ~15 us per
        # FSDP2 DTensor (its dispatch); _add detaches what needs it, and a DTensor's local
        # tensor needs none (the copy reads it, nothing records a graph). Only torch's own
        # state_dict (FSDP2, DDP and compiled modules keep it): a script's override may not
        # take keep_vars.
        return value.state_dict(keep_vars=True)
    return value if kind == "value" else value.state_dict()


@dataclasses.dataclass
class FlatState:
    """A flattened state: tensors in payload order, their names, and the JSON meta.

    The tensors are the live ones (no copy): copy them into a snapshot buffer before the
    optimizer next changes them.
    """

    names: list[str]
    tensors: list[torch.Tensor]
    meta: dict[str, Any]
    key_parts: list[tuple] | None = None  # flatten's, joined by key()

    def key(self) -> tuple:
        """(name, dtype, shape) per tensor: equal while the layout stays the same. Parts a
        memo gave are the same tuples as the last time, so comparing them is cheap."""
        if self.key_parts is None:
            return tensor_key(self.names, self.tensors)
        return tuple(itertools.chain.from_iterable(self.key_parts))

    def layout(self, job: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
        """The snapshot layout of this state for ``job`` (header reserve includes the meta)."""
        return layout(map(spec_of, self.names, self.tensors), job=job, meta=self.meta,
                      block_size=block_size)


_KNOWN_DTYPES: set[torch.dtype] = set()


class _Flattener:
    def __init__(self, memo: dict[str, DictMemo] | None = None) -> None:
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.used: set[str] = set()  # the names given so far
        self._memo = memo
        self._renamed = False
        self.key_parts: list[tuple] = []
        self.keyed = 0  # tensors [0, keyed) are in key_parts

    def key_part(self) -> list[tuple]:
        """key_parts, with the tensors added since the last part as one more."""
        if self.keyed < len(self.tensors):
            self.key_parts.append(tensor_key(self.names[self.keyed:], self.tensors[self.keyed:]))
            self.keyed = len(self.tensors)
        return self.key_parts

    def extend(self, names: list[str], tensors: list[torch.Tensor], key: tuple) -> None:
        """Adds tensors a memo gave back, with their names (free: the memo checked) and their
        key part as it recorded it."""
        self.key_part()
        self.names.extend(names)
        self.tensors.extend(tensors)
        self.used.update(names)
        self.key_parts.append(key)
        self.keyed = len(self.tensors)

    def _add(self, path: str, tensor: torch.Tensor) -> int:
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise UnsupportedValue(f"{path}: only dense tensors can be snapshotted ({tensor.layout})")
        if tensor.is_meta:  # no data: a model built on the meta device and never materialised
            raise UnsupportedValue(f"{path}: on the meta device (no data): give the model real "
                                   "storage (model.to_empty(device=...)) and initialise it "
                                   "before restore and save (docs/worker-api.md)")
        if tensor.dtype not in _KNOWN_DTYPES:  # checked once per dtype: flatten runs every step
            spec_of(path, tensor)  # raises for a dtype the format does not know
            _KNOWN_DTYPES.add(tensor.dtype)
        name, n = path, 1
        while name in self.used:  # "a/b" as a key and as a nested path would collide
            n += 1
            name = f"{path}~{n}"
            self._renamed = True
        self.used.add(name)
        self.names.append(name)
        # A module's parameters come as themselves (keep_vars): a copy must not see their
        # grad; a tensor that needs none is kept as it is (detach() makes a new object).
        self.tensors.append(tensor.detach() if tensor.requires_grad else tensor)
        return len(self.tensors) - 1

    def encode(self, value: Any, path: str) -> Any:
        t = type(value)
        # Plain leaves first: they are most of the calls (param-group ids, hyper-parameters,
        # dict keys), and flatten runs on the training thread every step.
        if t is int or t is str or t is bool or value is None:
            return value
        if t is torch.Tensor or t is torch.nn.Parameter:
            return {"@": "tensor", "i": self._add(path, value)}
        if isinstance(value, torch.Tensor):
            return self._subclass(value, path)
        if isinstance(value, np.ndarray) and value.dtype.kind in _NUMPY_KINDS:
            # Flattened here rather than with ascontiguousarray, which turns 0-dim into 1-dim.
            flat = np.ascontiguousarray(value.reshape(-1))
            if not flat.flags.writeable:  # torch.from_numpy warns on read-only arrays
                flat = flat.copy()
            raw = torch.from_numpy(flat.view(np.uint8))
            return {"@": "ndarray", "i": self._add(path, raw), "dtype": value.dtype.str,
                    "shape": list(value.shape)}
        if isinstance(value, np.generic) and value.dtype.kind in _NUMPY_KINDS:
            return {"@": "npscalar", "dtype": value.dtype.str, "hex": value.tobytes().hex()}
        if t is float:
            # JSON has no inf/nan; repr round-trips every finite float exactly.
            return value if math.isfinite(value) else {"@": "float", "v": repr(value)}
        if t is complex:
            return {"@": "complex", "v": [self.encode(value.real, path), self.encode(value.imag, path)]}
        if t is bytes:
            return {"@": "bytes", "hex": value.hex()}
        if t is list:
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if t is tuple:
            return {"@": "tuple", "v": [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if t is torch.Size:
            return {"@": "size", "v": list(value)}
        if t is torch.dtype:
            return {"@": "dtype", "v": dtype_name(value)}
        if t in (dict, collections.OrderedDict):
            return self._encode_dict(value, path)
        raise UnsupportedValue(
            f"{path}: cannot snapshot a {t.__qualname__}; put plain values, tensors or objects "
            "with state_dict()/load_state_dict() in the state"
        )

    def _subclass(self, value: torch.Tensor, path: str) -> dict[str, Any]:
        dtensor = shards.dtensor_class()
        if dtensor is not None and isinstance(value, dtensor):
            try:
                local, node = shards.describe(path, value)
            except shards.UnsupportedShard as exc:
                raise UnsupportedValue(str(exc)) from exc
            return {"@": "dtensor", "i": self._add(path, local), **node}
        # A subclass's storage is not its value (DTensor before this, lazy, quantised or
        # wrapper tensors): copying its bytes would snapshot something else, or fail later.
        raise UnsupportedValue(
            f"{path}: cannot snapshot a {type(value).__qualname__} (a tensor subclass): only "
            "plain tensors and DTensors (FSDP2) are stored")

    def _encode_dict(self, value: dict, path: str) -> dict[str, Any]:
        memo = self._memo
        if memo is None:
            return self._encode_dict_now(value, path)
        hit = memo.get(path)
        if hit is not None:
            node = hit.reuse(self, value)
            if node is not None:
                return node
            del memo[path]
        levels = depth(value)
        if not levels:
            return self._encode_dict_now(value, path)
        # Recorded whole: its inner dicts are not memoized on their own.
        base, renamed, self._memo, self._renamed = len(self.tensors), self._renamed, None, False
        try:
            node = self._encode_dict_now(value, path)
            if not self._renamed:  # a name that depends on what came before is not reused
                memo[path] = DictMemo(self, value, levels, base, node)
        finally:
            self._memo, self._renamed = memo, renamed or self._renamed
        return node

    def _encode_dict_now(self, value: dict, path: str) -> dict[str, Any]:
        keys = []
        for k in value:
            t = type(k)
            if t is str or t is int:  # most keys: they encode as themselves
                keys.append(k)
            elif k is None or t in (bool, float, tuple):
                keys.append(self.encode(k, path))
            else:
                raise UnsupportedValue(f"{path}: dict key {k!r} of type {t.__qualname__}")
        node = {"@": "odict" if type(value) is collections.OrderedDict else "dict", "k": keys,
                "v": [self.encode(v, f"{path}/{k}") for k, v in value.items()]}
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:  # nn.Module state dicts: per-module versions for migrations
            node["meta"] = self.encode(metadata, f"{path}/_metadata")
        return node


def flatten(state: Mapping[str, Any], memo: dict[str, Any] | None = None) -> FlatState:
    """Splits ``state`` into tensors and JSON meta (see the module docstring for what it takes).

    ``memo``: a dict the caller keeps between calls (empty at first) to flatten the same
    state faster the next time: the meta's nodes of unchanged tensor dicts are then the same
    objects as the last call's (do not modify them).

    Raises:
        UnsupportedValue: a value with no exact pickle-free form; the message gives its path.
    """
    f = _Flattener(memo)
    objects = []
    optimizers: dict[str, Any] = {}
    modules = []
    for key, value in state.items():
        if not isinstance(key, str):
            raise UnsupportedValue(f"state keys must be strings, got {key!r}")
        kind = _kind(value)
        if kind == "optimizer":
            optimizers[key] = value
        elif kind == "module":
            modules.append(value)
        objects.append([key, kind, f.encode(_state_of(kind, value), key)])
    meta: dict[str, Any] = {"v": META_VERSION, "objects": objects}
    names = {key: fqns for key, opt in optimizers.items()
             if (fqns := _param_names(opt, modules)) is not None}
    if names:
        meta["param_names"] = names
    return FlatState(f.names, f.tensors, meta, f.key_part() if memo is not None else None)


#: optimizer -> (its parameters' ids, the module they were named in, their names): flatten runs
#: every step and a model's parameters rarely change.
_NAMES_CACHE: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], Any, list[str]]] = (
    weakref.WeakKeyDictionary())


def _param_names(opt: torch.optim.Optimizer, modules: list[torch.nn.Module]) -> list[str] | None:
    """Each of ``opt``'s parameters' name in the first module of the state that holds them all,
    in the order of its ``state_dict()``'s indices; None when no module does.

    Only the persistent tier uses them: it keys an optimizer's state by parameter name there
    (``optim.state.<name>.exp_avg``), the key ``torch.distributed.checkpoint`` gives the same
    value in a ``get_state_dict`` state dict, so standard tools load it by name at any world
    size. The snapshot itself keeps the optimizer's own index keys (what it loads from).
    """
    ids = tuple(id(p) for g in opt.param_groups for p in g["params"])
    cached = _NAMES_CACHE.get(opt)
    if cached is not None and cached[0] == ids and any(m is cached[1] for m in modules):
        return cached[2]
    for module in modules:
        # A parameter shared by two names keeps the first, as named_parameters() reports it.
        named = {id(p): name for name, p in module.named_parameters()}
        if all(i in named for i in ids):
            names = [named[i] for i in ids]
            _NAMES_CACHE[opt] = (ids, module, names)
            return names
    return None


class _Unflattener:
    def __init__(self, tensors: list[torch.Tensor], dtensors: Any = None) -> None:
        self.tensors = tensors
        self.dtensors = dtensors  # builds a DTensor from its node (shards.Resharder)

    def _tensor(self, index: Any) -> torch.Tensor:
        if type(index) is not int or not 0 <= index < len(self.tensors):
            raise StateError(f"tensor index {index!r} out of range ({len(self.tensors)} tensors)")
        return self.tensors[index]

    @staticmethod
    def _np_dtype(name: Any) -> np.dtype:
        dtype = np.dtype(str(name))
        if dtype.kind not in _NUMPY_KINDS:  # never object/void views over raw bytes
            raise StateError(f"numpy dtype {name!r} is not a plain numeric dtype")
        return dtype

    def decode(self, node: Any, live: Any = None) -> Any:
        """``node``'s value; ``live``: the state's value at the same place now, or None."""
        t = type(node)
        if node is None or t in (bool, int, float, str):
            return node
        if t is list:
            return [self.decode(n) for n in node]
        if t is not dict:
            raise StateError(f"unexpected meta node {node!r:.60}")
        tag = node.get("@")
        if tag == "tensor":
            return self._tensor(node["i"])
        if tag == "dtensor":
            self._tensor(node.get("i"))
            if self.dtensors is None:
                raise StateError("the snapshot holds sharded tensors (DTensor): restore it into "
                                 "a state (load_into)")
            try:
                return self.dtensors(node, live)
            except shards.ShardError as exc:
                raise StateMismatch(str(exc)) from exc
        if tag in ("dict", "odict"):
            keys, values = node["k"], node["v"]
            if len(keys) != len(values):
                raise StateError("dict node with unequal keys and values")
            cls = collections.OrderedDict if tag == "odict" else dict
            decoded = [self.decode(k) for k in keys]
            out = cls((k, self.decode(v, _live_at(live, k))) for k, v in zip(decoded, values))
            if "meta" in node:
                out._metadata = self.decode(node["meta"])  # type: ignore[attr-defined]
            return out
        if tag == "tuple":
            return tuple(self.decode(n) for n in node["v"])
        if tag == "ndarray":
            raw = self._tensor(node["i"]).numpy()
            return raw.view(self._np_dtype(node["dtype"])).reshape(tuple(node["shape"]))
        if tag == "npscalar":
            return np.frombuffer(bytes.fromhex(node["hex"]), dtype=self._np_dtype(node["dtype"]))[0]
        if tag == "float":
            return float(node["v"])
        if tag == "complex":
            return complex(*(self.decode(n) for n in node["v"]))
        if tag == "bytes":
            return bytes.fromhex(node["hex"])
        if tag == "size":
            return torch.Size(node["v"])
        if tag == "dtype":
            dtype = getattr(torch, node["v"], None)
            if not isinstance(dtype, torch.dtype):
                raise StateError(f"unknown dtype {node['v']!r}")
            return dtype
        raise StateError(f"unknown meta tag {tag!r}")


def _live_at(live: Any, key: Any) -> Any:
    """``live[key]`` when ``live`` is a mapping holding it, else None."""
    with contextlib.suppress(TypeError):  # an unhashable key
        return live.get(key) if isinstance(live, Mapping) else None


def _objects(tensors: list[torch.Tensor], meta: Mapping[str, Any],
             dtensors: Any = None, live: Callable[[str], Any] = lambda key: None
             ) -> list[tuple[str, str, Any]]:
    version = meta.get("v") if isinstance(meta, Mapping) else None
    if type(version) is not int:
        raise StateMismatch("snapshot meta has no state version: not written by state.flatten")
    if version > META_VERSION:
        raise StateMismatch(f"snapshot state meta v{version} is newer than this elasticd's "
                            f"v{META_VERSION}; upgrade the worker's elasticd")
    decoder = _Unflattener(tensors, dtensors)
    try:
        return [(str(key), str(kind), decoder.decode(node, live(str(key))))
                for key, kind, node in meta["objects"]]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise StateError(f"snapshot state meta is malformed: {exc.__class__.__name__}: {exc}") from exc


def load_into(state: MutableMapping[str, Any], tensors: list[torch.Tensor],
              meta: Mapping[str, Any], *, strict: bool = True,
              others: Sequence[tuple[Sequence[str], list[torch.Tensor], Any]] = (),
              names: Sequence[str] = (), base_views: bool = False,
              files: SlotFiles | None = None) -> None:
    """Restores every entry of ``state`` in place from a flattened snapshot.

    Objects are loaded through their own ``load_state_dict``; plain values are replaced in the
    ``state`` mapping itself (read them back from it). ``tensors`` must be owned copies (e.g.
    from :func:`elasticd.worker.copier.read_tensors`): optimizers keep what they are given.

    Sharded tensors (DTensor) are rebuilt on the live state's device mesh: each rank's new
    local shard is assembled from the saved shards that cover it (:mod:`.shards`), this
    snapshot's and ``others``', so a snapshot of another world size loads too.

    Args:
        strict: the snapshot and ``state`` must have the same keys.
        others: (tensor names, tensors, meta) of the other old ranks' snapshots this rank's new
            shards need (:func:`elasticd.worker.shards.needed_ranks`).
        names: this snapshot's tensor names (to find the same tensors in ``others``).
        base_views: the sharded entries of ``tensors`` are views of a slot (read in place,
            as ``others`` are, a reshard): a new shard is never one of them but a copy, made
            straight into the state's own tensor where it fits (``Resharder``). Every other
            entry of ``tensors`` must still be an owned copy.
        files: the slot files the pieces read in place are mapped from (their rows are
            copied from the files, not through the mappings: :mod:`.slot_rows`).

    Raises:
        StateMismatch: different keys, a different kind of object under a key, an object
            that refused its state (shapes, parameter groups), or saved shards that do not
            cover this rank's new ones; the message names the key.
    """
    resharder = None

    def dtensor(node: Mapping[str, Any], live: Any = None) -> Any:
        nonlocal resharder
        if resharder is None:
            resharder = shards.Resharder(state, [(names, tensors, meta), *others],
                                         base_owned=not base_views, files=files)
        return resharder(node, live)

    def live(key: str) -> Any:
        return _live_state(state, key) if base_views else None

    objects = _objects(tensors, meta, dtensor, live)
    saved = [key for key, _, _ in objects]
    if strict and set(saved) != set(state):
        raise StateMismatch(
            f"snapshot holds {sorted(set(saved) - set(state))} that the state lacks, and the "
            f"state holds {sorted(set(state) - set(saved))} that the snapshot lacks"
        )
    for key, kind, value in objects:
        if key not in state:
            continue
        target = state[key]
        have = _kind(target)
        if have != kind:
            raise StateMismatch(f"state[{key!r}] is a {type(target).__qualname__} ({have}), the "
                                f"snapshot holds a {kind}")
        try:
            if kind == "value":
                state[key] = value
            elif kind == "zero":
                _load_zero(target, value, lambda key=key: _others_of(key, others))
            else:
                target.load_state_dict(value)
        except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise StateMismatch(f"state[{key!r}] ({type(target).__qualname__}) refused the "
                                f"snapshot: {exc}") from exc


def plan_rows(state: Mapping[str, Any], tensors: list[torch.Tensor], meta: Mapping[str, Any],
              files: SlotFiles, *, others: Sequence[Any] = (), names: Sequence[str] = ()
              ) -> list[RowCopy]:
    """The row copies :func:`load_into` (a reshard: ``base_views``, ``files``) would make out
    of ``files`` straight into the state's own tensors, worked out without copying or loading
    anything: the state is left as it is (:mod:`.direct` lands those rows itself).

    Raises:
        StateMismatch, StateError: as :func:`load_into` would for the same snapshot.
    """
    resharder = shards.Resharder(state, [(names, tensors, meta), *others], base_owned=False,
                                 files=files)
    copies: list[RowCopy] = []

    def dtensor(node: Mapping[str, Any], live: Any = None) -> None:
        copies.extend(resharder.plan(node, live))

    _objects(tensors, meta, dtensor, lambda key: _live_state(state, key))
    return copies


def _live_state(state: Mapping[str, Any], key: str) -> Any:
    """``state[key]``'s state dict, its very tensors (a module's, an optimizer's), or None."""
    target = state.get(key)
    with contextlib.suppress(Exception):  # an optimisation: else new tensors are made
        return target.state_dict() if _kind(target) in ("module", "optimizer") else None


def _others_of(key: str, others: Sequence[tuple[Sequence[str], list[torch.Tensor], Any]]
               ) -> list[Any]:
    """The saved states under ``key`` in the other old ranks' snapshots (decoded lazily: only
    a resharded ZeroRedundancyOptimizer needs them)."""
    out = []
    for _, tensors, meta in others:
        for k, kind, node in meta.get("objects", ()):
            if k == key and kind == "zero":
                try:
                    out.append(_Unflattener(tensors).decode(node))
                except (KeyError, IndexError, TypeError, ValueError) as exc:
                    raise StateError(f"another rank's snapshot of {key!r} is malformed: "
                                     f"{exc}") from exc
    return out


def _load_zero(zero: Any, saved: Mapping[str, Any], others: Any = lambda: []) -> None:
    """Loads a ZeroRedundancyOptimizer: its own shard when the partition is the one saved
    (the same world size); otherwise, through ZeRO's own ``load_state_dict`` of the global
    state assembled from every old rank's shard (``others()``: their saved states) with the
    partition maps saved beside them, which is what loading a ``consolidate_state_dict``
    checkpoint does."""
    groups = saved["param_groups"]
    if len(groups) != len(zero.param_groups):
        raise StateMismatch(f"ZeroRedundancyOptimizer has {len(zero.param_groups)} param groups, "
                            f"the snapshot {len(groups)}")
    index = zero._param_to_index
    mine = [index[p] for g in zero.optim.param_groups for p in g["params"]]
    if saved.get("global", mine) == mine:  # no map: an older elasticd, at the same world size
        zero.optim.load_state_dict(saved["shard"])
        for group, hyper in zip(zero.param_groups, groups):
            group.update(hyper)
        return
    state: dict[int, Any] = {}
    parts = [saved, *others()]  # decoded once
    for part in parts:
        if "global" not in part:
            raise StateMismatch("a ZeroRedundancyOptimizer snapshot without its partition map "
                                "(an older elasticd) cannot be loaded at another world size")
        local = part["shard"]["state"]
        for i, g in enumerate(part["global"]):
            if i in local:
                state.setdefault(g, local[i])
    held = {g for part in parts for g in part["global"]}
    if held != set(range(len(index))):
        raise StateMismatch(f"the old ranks' ZeroRedundancyOptimizer shards fetched hold "
                            f"{len(held)} of the {len(index)} parameters' state")
    zero.load_state_dict({"state": state, "param_groups": [
        {**hyper, "params": [index[p] for p in g["params"]]}
        for g, hyper in zip(zero.param_groups, groups)]})

"""flatten's memo of a tensor dict: the node it gave, reused while the dict's tensors are the
same objects with the same shapes (see :class:`DictMemo`). Worker side: imports torch.
"""

from __future__ import annotations

import collections
import operator
import weakref
from typing import Any, Sequence

import torch

from elasticd.worker import shards


class DictMemo:
    """What encoding one dict of tensors gave, and what it was made of, to give the same node
    again while nothing in it changed: a module's state dict, or an optimizer's per-parameter
    state (a dict of such dicts).

    Flatten runs on the training thread at every snapshot, and a model's state is mostly
    hundreds of tensors whose objects stay the same from step to step (updated in place):
    encoding them again costs ~2-4 us each (1.5 ms of a 2 ms stall, FSDP2, 384 tensors),
    checking that they are the same objects of the same shapes ~0.5 us. Only weak references
    are kept, so a memo never keeps a replaced model's memory alive.
    """

    __slots__ = ("base", "levels", "keys", "inner", "metadata", "leaves", "names", "node", "key")

    def __init__(self, f: Any, value: dict, levels: int, base: int, node: Any) -> None:
        """Records ``value`` (of :func:`depth` ``levels``), just encoded as ``node`` by the
        flattener ``f``, whose tensors from index ``base`` on are that node's."""
        self.base, self.levels, self.node = base, levels, node
        self.keys = list(value)
        self.metadata = getattr(value, "_metadata", None)
        dicts = list(value.values()) if levels == 2 else [value]
        # Weak references; an optimizer's absent buffer (None) stays None.
        self.inner = [(list(d), [(lambda: None) if v is None else weakref.ref(v)
                                 for v in d.values()]) for d in dicts]
        self.names = f.names[base:]
        self.key = tensor_key(self.names, f.tensors[base:])
        dtensor = shards.dtensor_class()
        self.leaves = []
        for v in [v for d in dicts for v in d.values() if v is not None]:
            is_d = dtensor is not None and isinstance(v, dtensor)
            src = v._local_tensor if is_d else v
            # The spec identifies the node the memo gives back; held weakly all the same: it
            # holds its mesh and so the round's process group, which an in-process survivor
            # must be able to free once it leaves its round (a dead spec: not the live one).
            self.leaves.append((weakref.ref(v), weakref.ref(src),
                                weakref.ref(v._spec) if is_d else None, src.shape, src.dtype))

    def reuse(self, f: Any, value: dict) -> Any:
        """The recorded node, its names and live tensors added to the flattener ``f``; None
        (``f`` untouched) if anything differs."""
        if (self.base != len(f.tensors) or list(value) != self.keys
                or getattr(value, "_metadata", None) != self.metadata
                or not f.used.isdisjoint(self.names)):
            return None
        for d, (keys, refs) in zip(value.values() if self.levels == 2 else [value], self.inner):
            if (type(d) not in (dict, collections.OrderedDict) or list(d) != keys
                    or not all(map(operator.is_, d.values(), [r() for r in refs]))):
                return None
        tensors = []
        for holder, source, spec, shape, dtype in self.leaves:
            h, src = holder(), source()
            # FSDP2 swaps a DTensor's local tensor on reset, and `.data =` a tensor's memory,
            # shape and dtype (same object): what is added is the live tensor, as _add would,
            # and its shape and dtype are what the recorded key says.
            if (src is None or (spec is not None and (h is None or h._spec is not spec()
                                                      or h._local_tensor is not src))
                    or src.shape != shape or src.dtype is not dtype):
                return None
            tensors.append(src.detach() if src.requires_grad else src)
        f.extend(self.names, tensors, self.key)
        return self.node


def tensor_key(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((n, t.dtype, t.shape) for n, t in zip(names, tensors))


def depth(value: dict) -> int:
    """1: a dict of tensors; 2: a dict of such dicts (tensors or None); 0: anything else."""
    vals = list(value.values())
    if not vals:
        return 0
    if all(isinstance(v, torch.Tensor) for v in vals):
        return 1
    if all(type(d) in (dict, collections.OrderedDict) and d and all(
            type(k) in (str, int) for k in d) and all(
            v is None or isinstance(v, torch.Tensor) for v in d.values()) for d in vals):
        return 2
    return 0

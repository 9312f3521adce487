"""One entry of a snapshot as a numpy array, for tests: the product reads a snapshot's entries
as torch tensors (:mod:`elasticd.worker.copier`), never as numpy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from elasticd.snapshot.format import Entry, Layout
from elasticd.snapshot.reader import SnapshotReader


def named(lay: Layout, name: str) -> Entry:
    """The entry of ``lay`` named ``name``."""
    return next(e for e in lay.entries if e.name == name)


def entry(buf: Any, name: str, dtype: Any, **expect: Any) -> np.ndarray:
    """Entry ``name`` of the snapshot in ``buf`` (header checked against ``expect``, payload
    verified), viewed as ``dtype`` without a copy."""
    e = named(SnapshotReader(buf, **expect).header.layout, name)
    count = e.nbytes // np.dtype(dtype).itemsize
    return np.frombuffer(buf, dtype=dtype, count=count, offset=e.offset).reshape(e.shape)

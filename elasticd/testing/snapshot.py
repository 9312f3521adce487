"""Loading a snapshot back into a state in one call, for tests that round-trip a state."""

from __future__ import annotations

from typing import Any, MutableMapping

from elasticd.snapshot.format import SnapshotHeader
from elasticd.worker.copier import read_tensors
from elasticd.worker.state import load_into


def load_snapshot(state: MutableMapping[str, Any], buffer: Any, header: SnapshotHeader) -> None:
    """Restores ``state`` from a snapshot in ``buffer`` (verified by the caller)."""
    load_into(state, read_tensors(buffer, header.layout), header.meta)

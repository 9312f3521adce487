"""What the checkpoint store hands out and the errors it raises, apart from the machinery.

The daemon loop, the replication server and the worker-facing endpoint all handle these types;
they live here so that none of them needs the store's internals (:mod:`elasticd.checkpoint.shm`).
Snapshot-format errors (:class:`~elasticd.checkpoint.format.SnapshotError` and its subclasses)
live with the format. No torch.
"""

from __future__ import annotations

import dataclasses

from elasticd.errors import CheckpointError


class SlotStoreError(CheckpointError):
    """Base class of the slot store's errors."""


class OverBudget(SlotStoreError):
    """A reservation would take the node over its memory cap (or the filesystem is full).

    Attributes:
        needed: extra bytes the reservation needed.
        held: bytes held at the time.
        cap: the cap (None when the filesystem itself was full).
    """

    def __init__(self, message: str, needed: int = 0, held: int = 0, cap: int | None = None):
        super().__init__(message)
        self.needed, self.held, self.cap = needed, held, cap


class SlotBusy(SlotStoreError):
    """The only free slot is pinned by a reader (e.g. replication still sending it)."""


class CommitPending(SlotBusy):
    """Both slots of a rank hold copies that must stay: the committed step and a newer copy a
    peer acknowledged, which may still be committed. The snapshot is skipped until that copy is
    committed or withdrawn (:meth:`SlotStore.unprotect`).

    Attributes:
        version: the acknowledged copy in the way, (generation, step).
        held: every copy held for the rank that is not the commit (``version`` among them).
    """

    def __init__(self, message: str, version: tuple[int, int],
                 held: tuple[tuple[int, int], ...] = ()):
        super().__init__(message)
        self.version = version
        self.held = held


class StaleSlot(SlotStoreError):
    """``complete`` was given a slot that has since been reserved again or removed."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """A reservation: write the snapshot's payload into ``buffer`` (or into ``path`` mapped by
    another process), then hand it back to :meth:`SlotStore.complete`.

    Attributes:
        job, rank: whose snapshot this slot is for.
        path: the file; it changes whenever the slot is re-allocated (grown), so a worker can
            cache its own mapping keyed on the path.
        capacity: the file's size in bytes (at least what was reserved).
        buffer: the daemon's writable mapping of the whole file.
        ticket: identifies this reservation.
    """

    job: str
    rank: int
    path: str
    capacity: int
    buffer: memoryview = dataclasses.field(repr=False)
    ticket: int = 0


@dataclasses.dataclass(frozen=True)
class ScanResult:
    """What :meth:`SlotStore.scan` found: kept snapshots as (job, rank, generation, step), and
    the paths it removed with the reason."""

    kept: list[tuple[str, int, int, int]]
    removed: list[tuple[str, str]]

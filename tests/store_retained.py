"""What a :class:`~elasticd.store.shm.SlotStore` retains, read in one place for the tests that
check it: the store keeps it in private fields and offers no view of them (nothing in the
product reads it whole), so a change there is mended here, not in every test."""

from __future__ import annotations

from typing import Any


def retained(store: Any, job: str, rank: int | None = None) -> set[tuple[int, int]]:
    """The versions ``store`` retains for every rank of ``job`` (``rank`` None: a commit's), or
    for ``rank`` alone (its newest pair's: an acknowledged copy); empty when none."""
    if rank is None:
        return set(store._retained.get(job, ()))
    pair = store._pairs.get((job, rank))
    return set(pair.retained) if pair is not None else set()


def retained_by_any_rank(store: Any) -> bool:
    """Whether any rank's pair of any job retains a version of its own."""
    return any(pair.retained for pair in store._pairs.values())

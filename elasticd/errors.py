"""The root of elasticd's exceptions, and the families under it.

Every exception class elasticd defines derives from :class:`ElasticdError`, so a caller can catch
anything the package raises on purpose in one clause (``tests/unit/test_exceptions.py`` checks
it). Under the root sit a few families (the classes below); each package's own base class joins
one. :class:`ReplicationError` is here rather than in its package because the checkpoint store,
below replication, catches :class:`ShardLost` from the fetcher it is handed;
``CoordinationError`` (``elasticd.coordination.api``) derives from the root directly: it is its
package's family. A class that callers catch as a builtin (``ValueError``, ``OSError``,
``RuntimeError``, ``TypeError``) keeps that base beside its family.

This module imports nothing from the package, so that every side (the worker, the rendezvous
plugin, the CLI) may import it.
"""

from __future__ import annotations

from typing import Sequence


class ElasticdError(Exception):
    """Base class of every exception elasticd defines."""


class InputError(ElasticdError):
    """Input that cannot be used as given (a setting, a job spec, a stored record, a command
    line); the message names it."""


class NodeError(ElasticdError):
    """This node's daemon, or a job it runs, cannot start or go on."""


class LocalProtocolError(ElasticdError):
    """A request between a worker or the CLI and its node's daemon failed or was refused."""


class CheckpointError(ElasticdError):
    """A snapshot cannot be written, held, read or restored as asked."""


class ReplicationError(ElasticdError):
    """Base class of every error the replication layer raises."""


class ShardLost(ReplicationError):
    """No holder could provide an intact copy: restore this shard from the persistent tier.

    Attributes:
        attempts: (holder, reason) for every holder tried, in order.
    """

    def __init__(self, job: str, rank: int, version: tuple[int, int] | None,
                 attempts: Sequence[tuple[str, str]]) -> None:
        tried = "; ".join(f"{h}: {r}" for h, r in attempts) or "no holder known"
        super().__init__(f"{job} rank {rank} {version or 'newest'}: no intact copy ({tried})")
        self.job, self.rank, self.version, self.attempts = job, rank, version, list(attempts)

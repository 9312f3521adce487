"""The coordination interface: what elasticd needs from etcd v3, and nothing more.

Everything in elasticd talks to a :class:`Coordinator`, never to an etcd client library.
Two implementations sit beside this file: :mod:`elasticd.coordination.etcd` (a real etcd v3
server through ``etcd-sdk-python``) and :mod:`elasticd.testing.coordination` (an in-memory fake
for unit tests). One contract test suite (``tests/unit/test_coordination_contract.py``) runs
against both, so the fake cannot drift from the real thing.

Keys and values are bytes on this interface; typed, versioned records live in
:mod:`elasticd.coordination.records`.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Callable, Protocol, Sequence

from elasticd.errors import ElasticdError


class CoordinationError(ElasticdError):
    """Base class of every error the coordination layer raises."""


class Unavailable(CoordinationError):
    """etcd could not be reached (every endpoint failed or timed out).

    Callers treat this as transient: retry with backoff, keep what runs running.
    """


class Refused(Unavailable):
    """etcd kept refusing a request, unapplied, for longer than the caller waits: its auth
    store changed under each try ("revision of auth store is old": users or roles changing,
    as when daemons create their agents' users). Nothing was applied; to the caller etcd is
    as good as unreachable, so it is handled like :class:`Unavailable`.
    """


class LeaseLost(CoordinationError):
    """The lease no longer exists on the server (it expired or was revoked)."""


class Compacted(CoordinationError):
    """A watch asked for a revision that etcd has already compacted away.

    The watcher must re-list the prefix and watch from the listing's revision.
    """

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}; re-list and re-watch")
        self.compact_revision = compact_revision


class AuthError(CoordinationError):
    """etcd refused the credentials (user/password or TLS client certificate)."""


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """One key as stored, with etcd's bookkeeping.

    Attributes:
        create_revision: revision of the put that created the key.
        mod_revision: revision of the last put to the key (use it for compare-and-set).
        version: number of puts since creation.
        lease: id of the lease the key is bound to, 0 for none.
    """

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int = 1
    lease: int = 0


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    """A change under a watched prefix.

    For DELETE events ``kv.value`` is empty. ``prev`` holds the key as it was before the
    event (with its lease), when the watch asked for it (``prev_kv``) and the server still had
    it; None otherwise.
    """

    type: EventType
    kv: KeyValue
    prev: KeyValue | None = None


#: Watch callbacks receive a batch of events, or an error that ended the watch stream. After an
#: error the implementation re-creates the watch from the next revision on its own; the error is
#: delivered so that the caller knows events may have been delayed. A :class:`Compacted` error
#: means events were lost: the caller must re-list.
WatchCallback = Callable[[Sequence[WatchEvent] | CoordinationError], None]


class Watch(abc.ABC):
    """Handle on a running watch."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stops the watch; no callback runs after this returns."""


@dataclasses.dataclass(frozen=True)
class Compare:
    """One condition of a transaction: the key's revision equals ``mod_revision`` (0 means:
    key absent).

    Attributes:
        target: ``"mod"`` compares the key's mod_revision (compare-and-set), ``"create"`` its
            create_revision (etcd's election recipe: a key re-created under a new lease, or by
            someone else, has another create_revision, so a deposed leader's write fails),
            ``"lease"`` the id of the lease the key is bound to: ``mod_revision`` then holds a
            lease id, and 0 means the key is absent or bound to no lease (etcd's LEASE target,
            etcd >= 3.3: a record that names another key's lease is written only while that
            key is bound to it).
    """

    key: bytes
    mod_revision: int
    target: str = "mod"

    def __post_init__(self) -> None:
        if self.target not in ("mod", "create", "lease"):
            raise ValueError(f"compare target {self.target!r}: use 'mod', 'create' or 'lease'")


@dataclasses.dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclasses.dataclass(frozen=True)
class Delete:
    key: bytes


Op = Put | Delete


class EtcdOnly(Protocol):
    """What an etcd connection offers beyond :class:`Coordinator` (:meth:`Coordinator.etcd`)."""

    def bound_refusals(self, seconds: float) -> None:
        """Repeats a request refused as older than the auth store for at most ``seconds``."""

    def auth_call(self, method: str, request: Any) -> Any:
        """Calls one of etcd's Auth RPCs (users and roles)."""


class Coordinator(abc.ABC):
    """A strongly consistent key-value store with leases and watches (the etcd v3 model).

    Every call takes at most the implementation's request timeout and raises
    :class:`Unavailable` when the store cannot be reached.
    """

    # -- keys -----------------------------------------------------------------------------

    @abc.abstractmethod
    def get(self, key: bytes) -> KeyValue | None:
        """Returns the key, or None when absent."""

    @abc.abstractmethod
    def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Returns every key under ``prefix`` sorted by key, and the store's revision."""

    @abc.abstractmethod
    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Writes unconditionally; returns the new revision."""

    @abc.abstractmethod
    def delete(self, key: bytes) -> bool:
        """Deletes one key; True when it existed."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: bytes) -> int:
        """Deletes every key under ``prefix``; returns how many."""

    @abc.abstractmethod
    def transaction(self, compares: Sequence[Compare], ops: Sequence[Op]) -> tuple[bool, int]:
        """Applies ``ops`` atomically if every compare holds.

        Returns:
            (succeeded, revision after the transaction).
        """

    def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Writes only if the key is absent; True when written."""
        return self.compare_and_set(key, value, 0, lease)

    def compare_and_set(self, key: bytes, value: bytes, mod_revision: int, lease: int = 0) -> bool:
        """Writes only if the key's mod_revision still equals ``mod_revision`` (0: absent)."""
        ok, _ = self.transaction([Compare(key, mod_revision)], [Put(key, value, lease)])
        return ok

    # -- leases ---------------------------------------------------------------------------

    @abc.abstractmethod
    def grant_lease(self, ttl: int) -> int:
        """Grants a lease of ``ttl`` seconds; returns its id."""

    @abc.abstractmethod
    def keep_alive(self, lease: int) -> float:
        """Refreshes a lease once; returns the TTL granted.

        Raises:
            LeaseLost: the lease expired or was revoked.
        """

    @abc.abstractmethod
    def revoke_lease(self, lease: int) -> None:
        """Revokes a lease, deleting every key bound to it. A missing lease is not an error."""

    # -- watches --------------------------------------------------------------------------

    @abc.abstractmethod
    def watch_prefix(self, prefix: bytes, callback: WatchCallback, start_revision: int,
                     prev_kv: bool = False) -> Watch:
        """Calls ``callback`` with every change under ``prefix`` from ``start_revision`` on.

        The watch survives server restarts and endpoint failover: it is re-created from the
        revision after the last one delivered.

        Args:
            prev_kv: deliver each event's previous key (``WatchEvent.prev``). Ask only when the
                callback reads it: etcd reads the previous value from its backend for every
                event and every watcher that asks (~38 µs of etcd CPU per event, against
                ~0.7 µs without).
        """

    @abc.abstractmethod
    def watch_key(self, key: bytes, callback: WatchCallback, start_revision: int) -> Watch:
        """As :meth:`watch_prefix`, for the one key ``key`` (no key that extends it): for a
        caller whose etcd role may read that key only."""

    def rewatch(self) -> None:
        """Re-creates every watch after an outage, in which a stream may have got stuck
        silently (a store whose watches cannot: nothing to do)."""

    @abc.abstractmethod
    def reset_watches(self) -> None:
        """Re-creates every watch from the store's current revision.

        For after etcd lost its data (restarted on an empty data directory): its revisions
        restart near 1, so a watch resumed from the old cluster's next revision would deliver
        nothing until the new cluster's revision passes that number. Events between the loss
        and the reset are not replayed: callers re-list what they follow.
        """

    # -- housekeeping ---------------------------------------------------------------------

    @abc.abstractmethod
    def revision(self, probe: bytes = b"\0") -> int:
        """The store's current revision (a cheap liveness probe).

        Args:
            probe: the key read to learn it: with etcd auth, pass one under the prefix the
                credentials may read (a role limited to its prefix may read no other key).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Releases connections and stops watches."""

    def etcd(self) -> EtcdOnly | None:
        """What only a real etcd offers beyond this interface (None: not an etcd)."""
        return None


def prefix_range_end(prefix: bytes) -> bytes:
    """The etcd range end that selects every key starting with ``prefix``."""
    head = prefix.rstrip(b"\xff")  # its last byte below 0xFF, incremented, ends the range
    return head[:-1] + bytes([head[-1] + 1]) if head else b"\0"

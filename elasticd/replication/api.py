"""The replication layer's interfaces: what a snapshot transfer is, where its bytes land, and
the errors every part raises.

A snapshot travels as a :class:`Descriptor` (whose shard, which version, how many bytes) plus
its bytes: the snapshot header followed by the raw tensor bytes. On the receiving daemon the
transport asks a :class:`Sink` where the bytes must land (daemon shared memory), writes
them there directly, and commits or aborts. The version rule that keeps a late or torn transfer
from ever replacing a newer good copy lives here, in the :class:`Sink` base class, so every sink
implementation shares it.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from typing import Any

# Defined below the store, which catches ShardLost from a restore's fetcher; callers import
# both from here too.
from elasticd.errors import ReplicationError, ShardLost

#: Reasons a sink (and so a NACK) gives for refusing a transfer.
STALE = "stale"  # a newer (generation, step) is already held for that shard
EXISTS = "exists"  # exactly this (generation, step) is already held (e.g. a retried push)
IN_PROGRESS = "in_progress"  # the same version is being received on another connection
NO_SPACE = "no_space"  # the sink's memory budget cannot take it
NOT_FOUND = "not_found"  # fetch: no such held snapshot
BAD_RANGE = "bad_range"  # fetch: the byte range asked for lies outside the snapshot
NOT_COORDINATOR = "not_coordinator"  # a commit report to a server that takes none

MAX_JOB_NAME = 256


class Refused(ReplicationError):
    """A sink declined a transfer (sent to the peer as a NACK with ``reason``).

    Attributes:
        reason: a short machine-readable code, e.g. :data:`STALE`.
    """

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message


class ConnectionLost(ReplicationError):
    """The connection closed, reset or timed out; the transfer in progress did not happen."""


class TransferTimeout(ConnectionLost):
    """Nothing arrived within the allowed time (idle timeout, handshake deadline)."""


class DeadlineExceeded(TransferTimeout):
    """A call did not finish within its whole-call deadline (a frozen or black-holed peer, or
    one far slower than measured); the connection is unusable. Not retried on the same peer."""


class RemoteError(ReplicationError):
    """The peer reported an error (an ERROR frame) and closed the connection.

    Attributes:
        code: the peer's short error code, e.g. ``"auth"`` or ``"protocol"``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"peer reported {code}: {message}")
        self.code = code
        self.message = message


Version = tuple[int, int]
"""(generation, step): a fallback to an older persisted step opens a new generation, so a copy
from an abandoned timeline never compares newer than one from the current timeline."""


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """One shard snapshot in transit.

    Attributes:
        owner_rank: global rank whose shard this is.
        generation: timeline (bumped on a fallback to an older persisted step).
        total_bytes: snapshot header plus payload, the bytes the receiver must store.
        header_bytes: length of the snapshot header at the start of those bytes.
    """

    job: str
    owner_rank: int
    generation: int
    step: int
    total_bytes: int
    header_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not 0 < len(self.job) <= MAX_JOB_NAME:
            raise ValueError(f"job must be a non-empty string of at most {MAX_JOB_NAME} chars, "
                             f"got {self.job!r:.80}")
        for name in ("owner_rank", "generation", "step", "total_bytes", "header_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                raise ValueError(f"{name} must be an integer in [0, 2**63), got {value!r}")
        if self.header_bytes > self.total_bytes:
            raise ValueError(f"header_bytes {self.header_bytes} exceeds total_bytes "
                             f"{self.total_bytes}")

    @property
    def version(self) -> Version:
        return (self.generation, self.step)

    @property
    def shard(self) -> tuple[str, int]:
        """(job, owner_rank): the shard whose versions compete."""
        return (self.job, self.owner_rank)


def check_version(held: Version | None, incoming: Version) -> None:
    """The version rule every sink applies, at begin and again when the copy landed.

    Raises:
        Refused: :data:`STALE` when ``incoming`` is older than ``held``; :data:`EXISTS` when it
            is the same version (the holder already has a verified copy of that snapshot, so a
            pusher that lost the first ACK may count this as success).
    """
    if held is None or tuple(incoming) > tuple(held):
        return
    if tuple(incoming) == tuple(held):
        raise Refused(EXISTS, f"already holding (generation, step) {tuple(held)}")
    raise Refused(STALE, f"holding (generation, step) {tuple(held)}, offered {tuple(incoming)}")


class Sink(abc.ABC):
    """Where received snapshots land, and where fetches read them from.

    The transport calls the public methods: :meth:`begin` (get the writable memory), then exactly
    one of :meth:`landed` or :meth:`abort`; :meth:`read` and :meth:`release` around a fetch.
    They apply the version rule and keep track of transfers in flight; implementations provide
    the storage primitives below them (:meth:`allocate`, :meth:`publish`, :meth:`discard`,
    :meth:`held`, :meth:`lookup`). The base class calls every primitive under its own lock
    except :meth:`allocate`, which may be slow (mapping memory) and must be thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: set[Descriptor] = set()

    # -- called by the transport -------------------------------------------------------------

    def begin(self, d: Descriptor) -> memoryview:
        """Reserves memory for ``d`` and returns a writable view of exactly ``d.total_bytes``.

        Raises:
            Refused: stale version, same version already in flight, or no space.
        """
        with self._lock:
            held = self.held(d.job, d.owner_rank)
            check_version(held.version if held else None, d.version)
            if any(f.shard == d.shard and f.version == d.version for f in self._in_flight):
                raise Refused(IN_PROGRESS, f"{d.version} of rank {d.owner_rank} is already "
                                           "being received")
            self._in_flight.add(d)
        try:
            view = self.allocate(d)
        except BaseException:
            with self._lock:
                self._in_flight.discard(d)
            raise
        if len(view) != d.total_bytes or view.readonly:
            self.abort(d, "sink returned a wrong-sized or read-only buffer")
            raise ValueError(f"{type(self).__name__}.allocate returned {len(view)} bytes "
                             f"(readonly={view.readonly}) for {d.total_bytes}")
        return view

    def landed(self, d: Descriptor, tags: Any = None) -> None:
        """Makes a fully received, verified ``d`` the shard's current copy.

        Args:
            tags: the copy's block tags, when it came pretagged
                (:class:`~elasticd.replication.seal.BlockTags`, each checked as its block
                landed): kept with the copy, so that its fetches and later pushes send them on.

        Raises:
            Refused: :data:`STALE` when a newer version landed while ``d`` was in
                flight; ``d`` is then discarded.
        """
        with self._lock:
            if d not in self._in_flight:
                raise ReplicationError(f"landed {d} which is not in flight")
            self._in_flight.discard(d)
            held = self.held(d.job, d.owner_rank)
            try:
                check_version(held.version if held else None, d.version)
            except Refused as exc:
                self.discard(d, exc.reason)
                raise
            self.publish(d, tags)

    def abort(self, d: Descriptor, reason: str) -> None:
        """Drops an in-flight ``d`` (torn or corrupt transfer). Idempotent."""
        with self._lock:
            if d in self._in_flight:
                self._in_flight.discard(d)
                self.discard(d, reason)

    def read(self, job: str, owner_rank: int,
             version: Version | None = None) -> tuple[Descriptor, memoryview] | None:
        """The held snapshot of a shard (the newest when ``version`` is None), or None.

        The caller must call :meth:`release` when done with the view.
        """
        with self._lock:
            return self.lookup(job, owner_rank, version)

    def release(self, d: Descriptor) -> None:
        """Ends a :meth:`read`. Sinks that pin memory for readers override this."""

    def tags(self, d: Descriptor) -> Any:
        """The block tags kept with the copy a :meth:`read` of ``d`` returned (call before
        :meth:`release`), or None: a fetch of it then tags its blocks on the way."""
        return None

    # -- storage primitives ------------------------------------------------------------------

    @abc.abstractmethod
    def allocate(self, d: Descriptor) -> memoryview:
        """Returns writable memory of ``d.total_bytes`` for an in-flight transfer.

        Raises:
            Refused: :data:`NO_SPACE` when the memory budget cannot take it.
        """

    @abc.abstractmethod
    def publish(self, d: Descriptor, tags: Any = None) -> None:
        """Makes the allocated bytes of ``d`` the held copy of its shard (replacing and
        freeing any older one), with its block tags when it has them (see :meth:`landed`)."""

    @abc.abstractmethod
    def discard(self, d: Descriptor, reason: str) -> None:
        """Frees the memory allocated for an in-flight ``d``."""

    @abc.abstractmethod
    def held(self, job: str, owner_rank: int) -> Descriptor | None:
        """The descriptor of the shard's newest held copy, or None."""

    @abc.abstractmethod
    def lookup(self, job: str, owner_rank: int,
               version: Version | None) -> tuple[Descriptor, memoryview] | None:
        """A held copy (the newest when ``version`` is None), or None."""

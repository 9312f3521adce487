"""One watch on etcd that survives its stream (see :mod:`elasticd.coordination.etcd`).

Trap of ``pyetcd`` this module guards against (docs/facts.md): a watch creation answered late
binds another watch's events to the next watch created on the stream. So every event's key is
checked against the watch's own range; one outside it means the stream cannot be trusted: the
callback gets a :class:`CoordinationError` (as for a broken stream, so its owner re-lists) and
the watch is re-created.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import TYPE_CHECKING, Any

import elasticd.coordination.grpc_fork  # noqa: F401  (before grpc: see it)
import pyetcd

from elasticd.coordination.api import (
    Compacted,
    CoordinationError,
    EventType,
    KeyValue,
    Unavailable,
    Watch,
    WatchCallback,
    WatchEvent,
)

if TYPE_CHECKING:
    from elasticd.coordination.etcd_connection import EtcdConnection

log = logging.getLogger(__name__)


def to_kv(kv: Any) -> KeyValue:
    """A pyetcd (protobuf) key-value as this package's :class:`KeyValue`."""
    return KeyValue(
        key=bytes(kv.key),
        value=bytes(kv.value),
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )


class ResilientWatch(Watch):
    """A prefix (or one-key: ``exact``) watch that re-creates itself after the stream fails.

    The next start revision is always ``last delivered revision + 1``, so no event is lost or
    delivered twice across a reconnect (unless etcd compacted the gap: the callback then gets
    :class:`Compacted` and must re-list).
    """

    def __init__(self, connection: EtcdConnection, prefix: bytes, callback: WatchCallback,
                 start_revision: int, prev_kv: bool = False, exact: bool = False) -> None:
        self._connection, self.prefix = connection, prefix
        self._prev_kv, self._exact = prev_kv, exact
        self._callback = callback
        self._next_revision = start_revision
        self._lock = threading.Lock()
        self._watch_id: int | None = None
        self._client: Any = None
        self._generation = 0
        self._cancelled = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._refused = False  # logged a foreign key already (log once per watch)

    def start(self) -> None:
        """Creates the first stream synchronously, so that errors other than an outage reach
        the caller; during an outage the stream is created in the background when etcd returns.
        """
        try:
            self._create()
        except Unavailable:
            self._wake.set()
        self._thread = threading.Thread(
            target=self._maintain, name=f"watch:{self.prefix!r}", daemon=True
        )
        self._thread.start()

    def _create(self) -> None:
        with self._lock:
            self._generation += 1
            generation = self._generation
            start = self._next_revision

        def run(c: Any) -> tuple[Any, int]:
            add = c.add_watch_callback if self._exact else c.add_watch_prefix_callback
            return c, add(self.prefix, functools.partial(self._on_response, generation),
                          start_revision=start or None, prev_kv=self._prev_kv)

        client, watch_id = self._connection.call(run)
        with self._lock:
            self._client, self._watch_id = client, watch_id

    def _on_response(self, generation: int, resp: Any) -> None:
        if self._cancelled.is_set():
            return
        with self._lock:
            if generation != self._generation:
                return  # a stream we already replaced
        if isinstance(resp, BaseException):
            err = self._connection.translate(resp)
            if isinstance(err, Compacted):
                # Events are gone: the caller re-lists; we continue from the compaction point.
                with self._lock:
                    self._next_revision = err.compact_revision
            self._safe_callback(err)
            self._wake.set()
            return
        # A watch that did not ask for prev_kv gets none: not looked for, per event.
        put, prev_kv = pyetcd.events.PutEvent, self._prev_kv
        events = [WatchEvent(EventType.PUT if type(e) is put else EventType.DELETE,
                             to_kv(e._event.kv),
                             to_kv(e._event.prev_kv)
                             if prev_kv and e._event.HasField("prev_kv") else None)
                  for e in resp.events]
        # Keys outside what was watched: the key itself when exact, else its prefix.
        foreign = [e.kv.key for e in events if (e.kv.key != self.prefix if self._exact
                                                else not e.kv.key.startswith(self.prefix))]
        if foreign:
            self._refuse_stream(generation, foreign)
            return
        if events:
            with self._lock:
                self._next_revision = max(self._next_revision, events[-1].kv.mod_revision + 1)
            self._safe_callback(events)

    def _refuse_stream(self, generation: int, foreign: list[bytes]) -> None:
        """A key outside this watch's range: the stream gave us another watch's events (see
        the module docstring). Nothing of it is delivered; the owner hears of a broken watch."""
        with self._lock:
            if generation != self._generation:
                return
            self._generation += 1  # ignore the rest of this stream until it is re-created
            first = not self._refused
            self._refused = True
        (log.warning if first else log.debug)(
            "watch on %r received %d key(s) outside it (first %r): the etcd client bound "
            "another watch's stream to it; re-creating the watch", self.prefix, len(foreign),
            foreign[0])
        self._safe_callback(CoordinationError(
            f"watch on {self.prefix!r} received a key outside it ({foreign[0]!r}); "
            "the watch is re-created"))
        self._wake.set()

    def _safe_callback(self, arg: Any) -> None:
        try:
            self._callback(arg)
        except Exception:  # a buggy callback must not kill the client's watch thread
            log.exception("watch callback for %r raised", self.prefix)

    def _maintain(self) -> None:
        backoff = 0.1
        while not self._cancelled.is_set():
            self._wake.wait()
            if self._cancelled.is_set():
                return
            self._wake.clear()
            self._drop_stream()
            while not self._cancelled.is_set():
                try:
                    self._create()
                    backoff = 0.1
                    break
                except CoordinationError as exc:
                    log.debug("re-creating watch on %r failed: %s", self.prefix, exc)
                    self._cancelled.wait(backoff)
                    backoff = min(backoff * 2, 2.0)

    def _drop_stream(self) -> None:
        with self._lock:
            client, watch_id = self._client, self._watch_id
            self._client = self._watch_id = None
            self._generation += 1
        if client is not None and watch_id is not None:
            with contextlib.suppress(Exception):  # the stream is broken: nothing to cancel
                client.cancel_watch(watch_id)

    def restart(self, from_revision: int = 0) -> None:
        """Re-creates the stream: from the revision after the last one delivered, or from
        ``from_revision`` (see :meth:`Coordinator.reset_watches`)."""
        if from_revision:
            with self._lock:
                self._next_revision = from_revision
        self._wake.set()

    def cancel(self) -> None:
        self._cancelled.set()
        self._wake.set()
        self._drop_stream()

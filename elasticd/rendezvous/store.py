"""The cross-node ``torch.distributed.Store`` that torch's dynamic rendezvous hands to agents.

``dynamic_rendezvous.create_handler(store, backend, params)`` needs a store that every node of
the job reaches. The agents use it (through a per-round ``PrefixStore``) to publish the workers'
``MASTER_ADDR``/``MASTER_PORT``, to exchange role and rank assignments (``multi_get`` /
``multi_set``), and for the exit barrier (``add`` + ``wait``). Here it is a directory of etcd keys,
``<prefix>/jobs/<run_id>/rdzv/store/<key>``, holding raw bytes, so the store survives the loss of
any node, unlike the c10d backend's TCPStore hosted by one agent.

Semantics follow torch's stores: ``get`` and ``wait`` block until the keys exist or the store's
timeout passes (0 means forever, as in c10d), ``add`` keeps a decimal string, and ``compare_set``
behaves like TCPStore's (absent key and empty ``expected``: create; else return the current
value, or ``expected`` for an absent key). Timeouts raise ``torch.distributed.DistStoreError``,
as TCPStore does (torch's v2 ``EtcdStore`` raised ``LookupError``, which ``store_util.barrier``
does not recognise as a timeout). Waiting polls with capped exponential backoff: a watch would
add a stream and a thread per agent for waits that are short (the rendezvous) or rare (the exit
barrier), and polling needs no resynchronisation after an outage.

Every etcd call rides out outages for the grace period (:mod:`.grace`). ``add`` and ``append`` are
made idempotent across a retried write whose outcome was unknown: the transaction also creates a
marker key unique to the call, which is checked when the compare fails and deleted afterwards.

Python-side method names are the ones torch's pybind trampoline calls: ``delete_key`` and
``num_keys`` reach it as ``deleteKey`` and ``getNumKeys``, so both spellings exist.
"""

from __future__ import annotations

import datetime
import logging
import random
import uuid
from typing import Callable, Sequence

import torch.distributed as dist

from elasticd.coordination.api import Compare, Coordinator, CoordinationError, KeyValue, Put
from elasticd.rendezvous.grace import OutageGrace

log = logging.getLogger(__name__)
#: First and longest pause between two polls for missing keys, seconds.
MIN_POLL, MAX_POLL = 0.005, 0.1

def _as_bytes(value: str | bytes | bytearray) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise TypeError(f"store values must be str or bytes, not {type(value).__name__}")


class EtcdV3Store(dist.Store):
    """A ``torch.distributed.Store`` on etcd v3 keys under ``key_prefix``.

    Args:
        key_prefix: the directory of store keys, ending in ``/``
            (``<prefix>/jobs/<run_id>/rdzv/store/``).
        timeout: how long ``get``/``wait`` block for missing keys; the c10d default if None.
        grace: retry policy for etcd outages (its clock also times waits and polls).
        abort: asked at every poll of a blocking wait; a reason (not None) ends the wait at
            once with ``DistStoreError`` (the handler's: a member of the round left, so the
            key it was to write will never come).
    """

    def __init__(self, coordinator: Coordinator, key_prefix: bytes,
                 timeout: datetime.timedelta | None = None, grace: OutageGrace | None = None,
                 abort: Callable[[], str | None] | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        if not key_prefix.endswith(b"/"):
            raise ValueError(f"store key prefix {key_prefix!r} must end with '/'")
        self._coordinator = coordinator
        self.prefix = key_prefix
        # Markers of add() calls live beside the store, so num_keys() does not count them.
        self._marker_prefix = key_prefix[:-1] + b"-adds/"
        self._grace = grace or OutageGrace()
        self._clock = self._grace.clock
        self.abort = abort
        self._clones: list[EtcdV3Store] = []  # see clone()
        if timeout is not None:
            self.set_timeout(timeout)

    # -- helpers --------------------------------------------------------------------------

    def _key(self, key: str | bytes) -> bytes:
        return self.prefix + _as_bytes(key)

    def _get(self, etcd_key: bytes) -> KeyValue | None:
        return self._grace.call(lambda: self._coordinator.get(etcd_key),
                                f"reading store key {etcd_key!r}")

    def _wait_for(self, keys: Sequence[str | bytes],
                  timeout: datetime.timedelta | None) -> list[bytes]:
        """Returns the keys' values once all exist (else ``DistStoreError``, as above)."""
        timeout = self.timeout if timeout is None else timeout
        seconds = timeout.total_seconds()
        deadline = self._clock.monotonic() + seconds if seconds > 0 else None
        found: dict[int, bytes] = {}
        pause = MIN_POLL
        while True:
            for i, key in enumerate(keys):
                if i not in found:
                    kv = self._get(self._key(key))
                    if kv is not None:
                        found[i] = kv.value
            if len(found) == len(keys):
                return [found[i] for i in range(len(keys))]
            missing_keys = [str(k) for i, k in enumerate(keys) if i not in found]
            reason = self.abort() if self.abort is not None else None
            if reason is not None:
                raise dist.DistStoreError(
                    f"gave up waiting for keys {missing_keys} in the etcd store "
                    f"{self.prefix.decode(errors='replace')}: {reason}")
            now = self._clock.monotonic()
            if deadline is not None and now >= deadline:
                # "timeout" is the word torch's stores use and its tests match ("[t -i]imeout").
                raise dist.DistStoreError(
                    f"wait timeout after {seconds:g} s: keys {missing_keys} missing in the etcd "
                    f"store {self.prefix.decode(errors='replace')}"
                )
            self._clock.sleep(pause if deadline is None else min(pause, deadline - now))
            pause = min(pause * 2, MAX_POLL)

    # -- the Store interface --------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        etcd_key = self._key(key)
        data = _as_bytes(value)
        self._grace.call(lambda: self._coordinator.put(etcd_key, data),
                         f"writing store key {etcd_key!r}")

    def get(self, key: str) -> bytes:
        """Returns the value, waiting up to the store's timeout for the key to appear."""
        return self._wait_for([key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Like :meth:`get` for several keys, within one timeout."""
        return self._wait_for(keys, None)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values):
            self.set(key, value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Blocks until every key exists (``timeout`` by default: the store's)."""
        self._wait_for(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        """True when every key exists now (no waiting)."""
        return all(self._get(self._key(k)) is not None for k in keys)

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the decimal integer at ``key`` (0 when absent); returns the sum."""
        total = self._update(key, lambda v: str(
            (0 if v is None else self._as_int(v, key)) + amount).encode(), "adding to")
        return int(total)

    def append(self, key: str, value: str | bytes) -> None:
        """Appends ``value`` to the key's value (creating it when absent): torch's extended
        store API, atomic as :meth:`add` is."""
        data = _as_bytes(value)
        self._update(key, lambda v: (v or b"") + data, "appending to")

    def has_extended_api(self) -> bool:
        """``append``, ``multi_get`` and ``multi_set`` are this store's own (torch's
        ``PrefixStore`` passes them through instead of failing with "Not implemented")."""
        return True

    def _update(self, key: str, change: Callable[[bytes | None], bytes], what: str) -> bytes:
        """Replaces the key's value (None: absent) by ``change`` of it, atomically: a
        transaction that checks the value read is still there, repeated until it lands."""
        etcd_key = self._key(key)
        marker = self._marker_prefix + uuid.uuid4().hex.encode()
        while True:
            kv = self._get(etcd_key)
            new = change(None if kv is None else kv.value)
            revision = 0 if kv is None else kv.mod_revision
            ok, _ = self._grace.call(
                lambda: self._coordinator.transaction(
                    [Compare(etcd_key, revision)], [Put(etcd_key, new), Put(marker, b"")]),
                f"{what} store key {etcd_key!r}")
            # A compare that failed may hide our own earlier attempt, applied by etcd before
            # the connection broke and the coordinator retried: the marker tells.
            if ok or self._get(marker) is not None:
                break
            self._clock.sleep(random.uniform(0, 0.01))  # contention: spread the retries
        try:
            self._coordinator.delete(marker)
        except CoordinationError as exc:  # a stray marker is harmless; don't wait for etcd
            log.debug("could not delete the update marker %r: %s", marker, exc)
        return new

    @staticmethod
    def _as_int(value: bytes, key: str) -> int:
        try:
            return int(value)
        except ValueError as exc:
            raise dist.DistStoreError(
                f"store key {key!r} holds {value[:32]!r}, not an integer: cannot add to it"
            ) from exc

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """Sets ``desired_value`` if the key holds ``expected_value`` (TCPStore's, above)."""
        etcd_key = self._key(key)
        expected = _as_bytes(expected_value)
        desired = _as_bytes(desired_value)
        while True:
            kv = self._get(etcd_key)
            if kv is None and expected:
                return expected
            if kv is not None and kv.value != expected:
                return kv.value
            revision = 0 if kv is None else kv.mod_revision
            ok = self._grace.call(
                lambda: self._coordinator.compare_and_set(etcd_key, desired, revision),
                f"compare-and-set of store key {etcd_key!r}")
            if ok:
                return desired
            # Lost a race (or our own retried write landed): re-read and decide again.

    def delete_key(self, key: str) -> bool:
        etcd_key = self._key(key)
        return self._grace.call(lambda: self._coordinator.delete(etcd_key),
                                f"deleting store key {etcd_key!r}")

    def num_keys(self) -> int:
        kvs, _ = self._grace.call(lambda: self._coordinator.get_prefix(self.prefix),
                                  "counting store keys")
        return len(kvs)

    def clone(self) -> "EtcdV3Store":
        """Another handle on the same keys (``c10d::Store::clone``), for another thread.

        It shares the etcd connection (thread-safe), the timeout, the outage grace and the
        abort check; torch calls it through its trampoline (``PrefixStore.clone`` and its
        own store tests do), where a Python store without it fails with "Tried to call pure
        virtual function c10d::Store::clone".

        This store keeps a reference to each clone: pybind's trampoline (torch 2.13) finds
        the Python methods through the Python object, so a clone only C++ still holds (a
        cloned ``PrefixStore``'s) would lose them ("Not implemented"). Clones are few: one
        per thread that asks.
        """
        twin = EtcdV3Store(self._coordinator, self.prefix, self.timeout, self._grace,
                           abort=self.abort)
        self._clones.append(twin)
        return twin

    # torch's pybind trampoline calls these C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys


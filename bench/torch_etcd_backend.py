"""torch's ``RendezvousBackend`` on etcd v3, kept as the baseline of ``scale_sim.py --handler torch``.

Until elasticd's own handler (:mod:`elasticd.rendezvous.handler`) replaced it behind
``--rdzv-backend etcd-v3``, this backend held torch's dynamic-rendezvous state in etcd; the scale
study measures torch's design on it (docs/scale.md). Not shipped in the package.

torch's dynamic rendezvous keeps the whole state of a rendezvous (round, participants, wait and
redundancy lists, heartbeats) in one opaque blob and needs only two operations from a backend:
read it with a fencing token, and write it if the token is still current. Here the blob lives
in one etcd key, ``<prefix>/jobs/<run_id>/rdzv/state``, and the token is that key's
``mod_revision``: a write is a transaction that compares it (0, "absent", for a first write).

Semantics mirror torch's own backends and their contract tests (``RendezvousBackendTestMixin``):
an invalid or stale token, or a None token when a state exists, does not raise; the caller gets
the current state and token with ``has_set=False``. A stored value that is not a state written
by this backend raises ``RendezvousStateError``.

The value is wrapped in a small envelope (magic, format version, xxh3 checksum) because etcd v3
stores raw bytes: without it a truncated or foreign value would reach ``pickle.loads`` in torch.
The checksum detects corruption, not an attacker: torch unpickles the state.

No TTL is put on the state: an etcd lease would need a keep-alive of its own. The state of a
finished run stays until the run's keys are deleted, and a closed state refuses new agents with
the same run id: use a fresh ``--rdzv-id`` per job, or delete ``<prefix>/jobs/<run_id>/rdzv/``.
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elasticd.coordination.api import Compare, Coordinator, Put
from elasticd.coordination.keys import Keyspace, check_name
from elasticd.rendezvous.grace import OutageGrace

BACKEND_NAME = "etcd-v3"

_MAGIC = b"EDRZ"
_FORMAT = 1
_HEADER = struct.Struct(">4sBQ")  # magic, format version, xxh3_64 of the payload


def encode_state(state: bytes) -> bytes:
    """Wraps torch's state blob in the envelope stored in etcd."""
    return _HEADER.pack(_MAGIC, _FORMAT, xxhash.xxh3_64_intdigest(state)) + state


def decode_state(raw: bytes, key: bytes | str = b"?") -> bytes:
    """Returns torch's state blob from a stored envelope.

    Raises:
        RendezvousStateError: the value is not an intact state of a format this code reads.
    """
    where = key.decode(errors="replace") if isinstance(key, bytes) else key
    hint = f"delete the key (`etcdctl del {where}`) to start this rendezvous afresh"
    if len(raw) < _HEADER.size or raw[:4] != _MAGIC:
        raise RendezvousStateError(
            f"The rendezvous state at {where} is corrupt: not written by the {BACKEND_NAME} "
            f"backend ({len(raw)} bytes, starting {raw[:8]!r}); {hint}."
        )
    _, version, digest = _HEADER.unpack_from(raw)
    if version != _FORMAT:
        raise RendezvousStateError(
            f"The rendezvous state at {where} has format {version}, this elasticd reads "
            f"format {_FORMAT}: run the same elasticd version on every node, or {hint}."
        )
    state = raw[_HEADER.size:]
    if xxhash.xxh3_64_intdigest(state) != digest:
        raise RendezvousStateError(
            f"The rendezvous state at {where} is corrupt: checksum mismatch; {hint}."
        )
    return state


def _is_valid_token(token: Any) -> bool:
    # Our tokens are etcd mod_revisions; bool is an int subclass but never a revision.
    return isinstance(token, int) and not isinstance(token, bool)


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Holds torch's rendezvous state in one etcd v3 key, fenced by its mod_revision.

    Args:
        coordinator: the etcd connection (never the client library directly).
        run_id: the rendezvous (torchrun ``--rdzv-id``); it names the job in the keyspace.
        keyspace: the cluster's key prefix.
        grace: retry policy for etcd outages; by default 30 s of retries.

    Raises:
        ValueError: an empty or invalid run id.
    """

    def __init__(self, coordinator: Coordinator, run_id: str, keyspace: Keyspace | None = None,
                 grace: OutageGrace | None = None) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        check_name("rendezvous run id", run_id)
        self._coordinator = coordinator
        self._keyspace = keyspace or Keyspace()
        self.key = self._keyspace.rendezvous(run_id).prefix + b"state"
        self._grace = grace or OutageGrace()

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class.

        Raises:
            RendezvousConnectionError: etcd unreachable for longer than the grace period.
            RendezvousStateError: the stored state is corrupt.
        """
        kv = self._grace.call(lambda: self._coordinator.get(self.key), "reading the rendezvous state")
        if kv is None:
            return None
        return decode_state(kv.value, self.key), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        """See base class.

        Raises:
            RendezvousConnectionError: etcd unreachable for longer than the grace period.
            RendezvousStateError: the stored state is corrupt.
        """
        if token and not _is_valid_token(token):
            # Not a token of ours: it cannot match, so the write fails (torch's semantics).
            return self._current_state(written=None)
        # torch's backends treat any falsy token as None: write only if no state exists.
        expected = int(token) if token else 0
        envelope = encode_state(state)
        ok, revision = self._grace.call(
            lambda: self._coordinator.transaction([Compare(self.key, expected)],
                                                  [Put(self.key, envelope)]),
            "writing the rendezvous state")
        if ok:
            return state, revision, True
        # The compare may have failed because etcd applied this very write before the reply
        # was lost and the call was retried (here or inside the coordinator): finding our own
        # bytes stored means the write took effect.
        return self._current_state(written=envelope)

    def _current_state(self, written: bytes | None) -> tuple[bytes, Token, bool] | None:
        kv = self._grace.call(lambda: self._coordinator.get(self.key), "reading the rendezvous state")
        if kv is None:
            return None
        has_set = written is not None and kv.value == written
        return decode_state(kv.value, self.key), kv.mod_revision, has_set

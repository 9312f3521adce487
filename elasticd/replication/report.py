"""What a node tells its job's commit coordinator, and what the coordinator answers.

A :class:`Report` is one node's whole commit state for one job: per rank it owns, the versions
that reached ``m`` verified copies (newest first), the versions that can never commit (a rank
skipped them, or the node withdrew them), its generation floor, and the revision of its fence
key (``ckpt/fence/<node>``) as of its last withdrawal. It replaces the node's previous report
whole, so a lost or repeated one does no harm, and it is sent over the authenticated
replication channel (:mod:`elasticd.replication.channel`), never written to etcd: the job's
etcd writes per committed step do not grow with its node count.

Which reports count (the ``term``, ``placement`` and ``fence`` they name):
:mod:`elasticd.replication.tally`. A :class:`Reply` says whether the report counts and, of the
versions the node waits on (``ask``), which can never commit (``hopeless``: the node then
withdraws them at once instead of waiting out ``withdraw_after``).

Both travel as small JSON objects, checked field by field here (a peer holds the cluster secret,
but a bug must not become a ``TypeError`` deep in a decision).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Mapping

import xxhash

from elasticd.coordination import records
from elasticd.replication.api import Version
from elasticd.replication.placement import Placement, encode_placement
from elasticd.replication.wire import MalformedFrame

#: Bounds on what one report may carry (anything larger is malformed).
MAX_RANKS = 65_536
MAX_VERSIONS = 4
MAX_DEAD = 16
MAX_ASK = 16


class MalformedReport(MalformedFrame):
    """A report or reply that does not decode as one (a protocol error: the connection
    ends)."""


_DIGESTS: dict[int, tuple[Placement, str]] = {}
_DIGESTS_LOCK = threading.Lock()


def placement_digest(placement: Placement | None) -> str:
    """A short name for ``placement`` (its stored encoding's xxh3-64): a report, the
    coordinator and the committed record agree on a placement by it. Remembered for the few
    placement objects in use (encoding one of thousands of nodes costs milliseconds, and every
    commit record read asks)."""
    if placement is None:
        return ""
    with _DIGESTS_LOCK:
        hit = _DIGESTS.get(id(placement))
    if hit is not None and hit[0] is placement:
        return hit[1]
    digest = xxhash.xxh3_64_hexdigest(encode_placement(placement))
    with _DIGESTS_LOCK:
        if len(_DIGESTS) >= 16:
            _DIGESTS.pop(next(iter(_DIGESTS)))
        _DIGESTS[id(placement)] = (placement, digest)  # holding it keeps its id unique
    return digest


@dataclasses.dataclass(frozen=True)
class Report:
    """One node's commit state for one job (see the module docstring).

    Attributes:
        term: the coordinator term this report is for.
        placement: :func:`placement_digest` of the placement the node is in.
        boot, seq: the sender's random incarnation number and a counter: a report older than
            one already received from the same incarnation is ignored.
        fence: mod_revision of the node's fence key when the report was made (0: none).
        floor: the node's generation floor (versions of older generations never count).
        ranks: per owned rank, versions with ``m`` copies, newest first.
        dead: versions that can never commit (skipped by a rank, or withdrawn).
        ask: versions the node waits on; the reply says which can never commit.
    """

    job: str
    node: str
    term: int
    placement: str
    boot: int
    seq: int
    fence: int
    floor: int
    ranks: Mapping[int, tuple[Version, ...]]
    dead: tuple[Version, ...] = ()
    ask: tuple[Version, ...] = ()

    def mentioned(self) -> set[Version]:
        """Every version the report names (listed or dead)."""
        return {v for vs in self.ranks.values() for v in vs} | set(self.dead)


@dataclasses.dataclass(frozen=True)
class Reply:
    """The coordinator's answer: whether the report counts (else ``reason``), which asked
    versions can never commit, and the coordinator's committed version."""

    accepted: bool
    reason: str = ""
    hopeless: tuple[Version, ...] = ()
    committed: Version | None = None


def version_list(value: Any, limit: int, what: str) -> tuple[Version, ...]:
    # A report names ~11 lists of versions (one per rank, dead, ask) and the coordinator
    # decodes one per node per step: each item is checked by its two ints unpacked, not by a
    # generator per item (half the cost; the same checks).
    if type(value) is not list or len(value) > limit:
        raise ValueError(f"{what}: expected a list of at most {limit} versions")
    out = []
    for item in value:
        if type(item) is not list or len(item) != 2:
            raise ValueError(f"{what}: {item!r:.40} is no [generation, step]")
        generation, step = item
        if (type(generation) is not int or type(step) is not int
                or generation < 0 or step < 0):
            raise ValueError(f"{what}: {item!r:.40} is no [generation, step]")
        out.append((generation, step))
    return tuple(out)


def count_field(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what}: expected an integer >= 0, got {value!r:.40}")
    return value


def encode_report(r: Report) -> bytes:
    return json.dumps({
        "job": r.job, "node": r.node, "term": r.term, "placement": r.placement,
        "boot": r.boot, "seq": r.seq, "fence": r.fence, "floor": r.floor,
        # json writes a tuple as a list: the same bytes as lists built per version
        "ranks": {str(k): vs for k, vs in sorted(r.ranks.items())},
        "dead": r.dead, "ask": r.ask},
        separators=(",", ":")).encode()


def decode_report(raw: bytes | memoryview) -> Report:
    """Raises: MalformedReport."""
    try:
        body = records.loads(bytes(raw))
        if not isinstance(body, dict):
            raise ValueError("not an object")
        ranks_in = body["ranks"]
        if not isinstance(ranks_in, dict) or len(ranks_in) > MAX_RANKS:
            raise ValueError(f"ranks: expected an object of at most {MAX_RANKS} ranks")
        ranks = {}
        for key, value in ranks_in.items():
            if not key.isdigit():
                raise ValueError(f"ranks: {key!r:.20} is no rank")
            ranks[int(key)] = version_list(value, MAX_VERSIONS, f"rank {key}")
        for name in ("job", "node", "placement"):
            if not isinstance(body[name], str) or len(body[name]) > 256:
                raise ValueError(f"{name}: expected a string")
        return Report(body["job"], body["node"], count_field(body["term"], "term"),
                      body["placement"], count_field(body["boot"], "boot"),
                      count_field(body["seq"], "seq"), count_field(body["fence"], "fence"),
                      count_field(body["floor"], "floor"), ranks,
                      version_list(body.get("dead", []), MAX_DEAD, "dead"),
                      version_list(body.get("ask", []), MAX_ASK, "ask"))
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise MalformedReport(f"malformed commit report: {exc}") from exc


def encode_reply(r: Reply) -> bytes:
    return json.dumps({"accepted": r.accepted, "reason": r.reason,
                       "hopeless": [list(v) for v in r.hopeless],
                       "committed": list(r.committed) if r.committed else None},
                      separators=(",", ":")).encode()


def decode_reply(raw: bytes | memoryview) -> Reply:
    """Raises: MalformedReport."""
    try:
        body = records.loads(bytes(raw))
        if not isinstance(body, dict) or not isinstance(body["accepted"], bool):
            raise ValueError("not a reply")
        committed = body.get("committed")
        return Reply(body["accepted"], str(body.get("reason", ""))[:200],
                     version_list(body.get("hopeless", []), MAX_ASK, "hopeless"),
                     version_list([committed], 1, "committed")[0] if committed else None)
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise MalformedReport(f"malformed commit reply: {exc}") from exc

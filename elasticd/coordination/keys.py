"""The etcd keyspace, in one place.

::

    <prefix>/cluster                            the cluster's incarnation (etcd data loss)
    <prefix>/nodes/<node>                       node record, bound to the node's lease
    <prefix>/events/<node>/<lease>/<kind>       cluster events (failure, departure, ...), bounded
    <prefix>/drain/<node>                       drain request and its progress (elasticctl drain)
    <prefix>/jobs/<job>/spec                    job spec (written once by elasticctl submit)
    <prefix>/jobs/<job>/control                 desired state: running | stopped
    <prefix>/jobs/<job>/nodes/<node>            a node's view of the job, bound to its lease
    <prefix>/jobs/<job>/rdzv/...                torchrun rendezvous state and store
    <prefix>/jobs/<job>/rdzv/native/round       the last closed rendezvous round (beside it:
                                                round.closer, round.waiting, round.closed;
                                                elasticd.rendezvous.records)
    <prefix>/jobs/<job>/placement               replica placement
    <prefix>/jobs/<job>/ckpt/committed          the committed step (elasticd.replication.commit)
    <prefix>/jobs/<job>/ckpt/committed.grid     the snapshot grid, beside it
    <prefix>/jobs/<job>/ckpt/committed.coordinator  the commit coordinator's election key
    <prefix>/jobs/<job>/ckpt/committed.ahead    the newest version with m copies past the commit
    <prefix>/jobs/<job>/ckpt/placement          the placement the committed holders derive from
    <prefix>/jobs/<job>/ckpt/fence/<node>       the versions a node withdrew
    <prefix>/jobs/<job>/ckpt/fence.epoch        bumped by every withdrawal of the job
    <prefix>/jobs/<job>/ckpt/replicated/<node>  the old commit protocol's per-node record
                                                (removed by a coordinator when it is elected)

Every value is a versioned record (:mod:`elasticd.coordination.records`), except the raw bytes
torch's rendezvous stores under ``rdzv/``.

Names read back out of keys are not trusted (anyone who may write to etcd picks them): they are
validated with a full match, so ``jobs/../spec`` or a name ending in a newline is no job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def check_name(what: str, name: str) -> str:
    """Validates a node or job name (it becomes part of etcd keys and file names)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(
            f"{what} {name!r} is not valid: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_prefix(prefix: str) -> str:
    if not prefix.startswith("/") or prefix.endswith("/") or "//" in prefix or len(prefix) < 2:
        raise ValueError(
            f"prefix {prefix!r} is not valid: it must start with '/', not end with '/', "
            "e.g. /elasticd"
        )
    return prefix


def _key(*parts: str) -> Any:
    """The key ``parts`` name under the object's directory (its ``_k``), as a property."""
    return property(lambda self: self._k(*parts))


@dataclass(frozen=True)
class _JobDir:
    path: str  # <prefix>/jobs/<job>

    def _k(self, *parts: str) -> bytes:
        return "/".join((self.path, *parts)).encode()


class JobKeys(_JobDir):
    """A job's own records: its spec, its desired state, each node's view of it."""

    spec = _key("spec")
    control = _key("control")
    nodes = _key("nodes", "")

    def node(self, node: str) -> bytes:
        return self._k("nodes", node)


class RendezvousKeys(_JobDir):
    """The torchrun rendezvous of a job (its records: :mod:`elasticd.rendezvous.records`)."""

    prefix = _key("rdzv", "")
    #: The record one compare-and-set writes to close a rendezvous round.
    round = _key("rdzv", "native", "round")


class ReplicationKeys(_JobDir):
    """A job's replica placement, commit and fences (:mod:`elasticd.replication.commit`)."""

    placement = _key("placement")
    ckpt = _key("ckpt", "")
    committed = _key("ckpt", "committed")
    #: Beside the committed record, so that one watch on its key (a prefix) sees both.
    commit_grid = _key("ckpt", "committed.grid")
    #: The commit coordinator's election key, under the committed record's prefix so that the one
    #: watch every node holds sees it.
    coordinator = _key("ckpt", "committed.coordinator")
    commit_ahead = _key("ckpt", "committed.ahead")
    commit_placement = _key("ckpt", "placement")
    #: The prefix of every fence key and the fence epoch (one range read sees both).
    fences = _key("ckpt", "fence")
    fence_epoch = _key("ckpt", "fence.epoch")
    fence_prefix = _key("ckpt", "fence", "")

    def fence(self, node: str) -> bytes:
        return self._k("ckpt", "fence", node)

    replicated_prefix = _key("ckpt", "replicated", "")

    def replicated(self, node: str) -> bytes:
        return self._k("ckpt", "replicated", node)


class Keyspace:
    """Builds and parses the keys under one cluster prefix; a job's keys through its three
    views (:meth:`job_keys`, :meth:`rendezvous`, :meth:`replication`)."""

    def __init__(self, prefix: str = "/elasticd") -> None:
        self.prefix = check_prefix(prefix)

    def _k(self, *parts: str) -> bytes:
        return "/".join((self.prefix, *parts)).encode()

    cluster = _key("cluster")

    # nodes
    nodes = _key("nodes", "")

    def node(self, node: str) -> bytes:
        return self._k("nodes", node)

    def node_of(self, key: bytes) -> str:
        """The node a ``nodes/<node>`` key names (``nodes/a/b`` names none: ValueError)."""
        return check_name("node id in key", key[len(self.nodes):].decode(errors="replace"))

    # events
    events = _key("events", "")

    def event(self, node: str, lease: int, kind: str) -> bytes:
        return self._k("events", node, f"{lease:016x}", kind)

    # drains
    drains = _key("drain", "")

    def drain(self, node: str) -> bytes:
        return self._k("drain", node)

    # jobs
    jobs = _key("jobs", "")

    def job(self, job: str) -> bytes:
        return self._k("jobs", job, "")

    def job_keys(self, job: str) -> JobKeys:
        return JobKeys(f"{self.prefix}/jobs/{job}")

    def rendezvous(self, job: str) -> RendezvousKeys:
        return RendezvousKeys(f"{self.prefix}/jobs/{job}")

    def replication(self, job: str) -> ReplicationKeys:
        return ReplicationKeys(f"{self.prefix}/jobs/{job}")

    def job_key(self, key: bytes) -> tuple[str, str, str]:
        """Splits ``<prefix>/jobs/<job>/<what>[/<rest>]`` into (job, what, rest)."""
        if not key.startswith(self.jobs):
            raise ValueError(f"{key!r} is not a job key")
        job, _, tail = key[len(self.jobs):].decode(errors="replace").partition("/")
        what, _, rest = tail.partition("/")
        return check_name("job name in key", job), what, rest

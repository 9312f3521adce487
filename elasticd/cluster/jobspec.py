"""Job specs: what ``elasticctl submit`` stores and every daemon runs.

A spec is validated where it is written (so nothing malformed ever reaches etcd) and checked
again where it is read and where it runs: anyone who may write to etcd may write a spec, so
decoding checks every field's type and value, and the name inside against the key's, and each
node applies its own policy (:mod:`elasticd.agent.job_check`: allowed users, the pinned
interpreter, refused environment variables, the files checked as the job's user, the script's
SHA-256). Jobs never run as root by accident: a spec submitted by root must
name ``--user``. The CLI and the daemon both read specs: this module imports neither.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pwd
import re
import sys
from typing import Any

from elasticd.clock import SYSTEM_CLOCK
from elasticd.coordination import records
from elasticd.coordination.keys import check_name
from elasticd.errors import InputError

KIND = "job_spec"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Set by elasticd or torchrun for the workers; a job may not override them.
RESERVED_ENV = ("ELASTICD_", "TORCHELASTIC_", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")


#: The default of :attr:`JobSpec.reform_deadline`, seconds.
DEFAULT_REFORM_DEADLINE = 10.0
#: The largest reform deadline a spec takes, seconds: a survivor stuck longer than this holds
#: its node's share of the job back for no good reason (the restart path is the fallback).
MAX_REFORM_DEADLINE = 3600.0
#: Fields with a range: (field, lowest, whether only above it, highest, unit in the message).
_RANGES = (("nproc_per_node", 1, False, 1024, ""), ("max_restarts", 0, False, 100_000, ""),
           ("crash_loop_restarts", 0, False, 100_000, ""),
           ("hang_timeout_floor", 0, True, 86400, " seconds"),
           ("hang_first_step", 0, True, 86400, " seconds"),
           ("reform_deadline", 0, True, MAX_REFORM_DEADLINE, " seconds"),
           ("straggler_steps", 1, False, 100_000, ""))


class JobSpecError(InputError, ValueError):
    """A job spec is malformed; the message says which field and what would be right."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parses ``N`` or ``MIN:MAX`` the way torchrun does, with a clear error."""
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        raise JobSpecError(f"--nnodes {text!r}: expected N or MIN:MAX, e.g. 2:3")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1 or hi < lo:
        raise JobSpecError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A training job. Its fields are ``elasticctl submit``'s options, whose help says what
    each means (:func:`elasticd.cli.jobs.add_parsers`); what the help does not say:

    Attributes:
        name: job name (also torchrun's rendezvous id).
        script_sha256: hash every node checks before it starts the job.
        created_at: wall time of submission.
        hang_timeout: None: learned from the job's step times
            (:mod:`elasticd.cluster.learned_timeout`).
        in_process: :mod:`elasticd.agent.in_process_agent`; specs written before it decode as
            False.
        reform_deadline: :func:`elasticd.agent.job_rules.reform_step`; the daemon's own backstop
            is this plus :data:`elasticd.agent.job_rules.REFORM_ROUND_ALLOWANCE`. Specs written
            before it decode with the default (10 s, what their agents used).
    """

    name: str
    nnodes_min: int
    nnodes_max: int
    nproc_per_node: int
    script: str
    args: list[str]
    script_sha256: str
    user: str
    cwd: str
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    python: str = sys.executable
    max_restarts: int = 100
    # None (learned) is the default; specs written before it carry their number (300).
    hang_timeout: float | None = None
    created_at: float = 0.0
    crash_loop_restarts: int = 5
    hang_timeout_floor: float = 60.0
    hang_first_step: float = 600.0
    straggler_factor: float = 1.5
    straggler_steps: int = 20
    straggler_drain: bool = False
    in_process: bool = False
    reform_deadline: float = DEFAULT_REFORM_DEADLINE

    def validate(self) -> "JobSpec":
        """Raises :class:`JobSpecError` on the first bad field, or a user or file missing here."""
        self.check_fields()
        try:
            pwd.getpwnam(self.user)
        except KeyError:
            raise JobSpecError(f"--user {self.user!r}: no such user on this machine") from None
        if not os.path.isfile(self.script):
            raise JobSpecError(f"script {self.script!r}: no such file")
        if not os.path.isdir(self.cwd):
            raise JobSpecError(f"--cwd {self.cwd!r}: no such directory")
        if not os.access(self.python, os.X_OK):
            raise JobSpecError(f"--python {self.python!r}: not an executable")
        return self

    def check_fields(self) -> "JobSpec":
        """The checks that need nothing from this machine. Raises :class:`JobSpecError`."""
        try:
            check_name("job name", self.name)
        except ValueError as exc:
            raise JobSpecError(str(exc)) from None
        if not 1 <= self.nnodes_min <= self.nnodes_max:
            raise JobSpecError(f"nnodes {self.nnodes_min}:{self.nnodes_max}: need 1 <= MIN <= MAX")
        for name, low, above, high, unit in _RANGES:
            value = getattr(self, name)
            if not ((low < value) if above else (low <= value)) or value > high:  # NaN too
                off = " (off)" if name == "crash_loop_restarts" else ""
                raise JobSpecError(f"--{name.replace('_', '-')} {value}: use "
                                   f"{'more than ' if above else ''}{low}{off} to {high:g}{unit}")
        if self.hang_timeout is not None and self.hang_timeout < 0:
            raise JobSpecError(f"--hang-timeout {self.hang_timeout}: must be >= 0 (0 turns it off)")
        if self.straggler_factor != 0 and not 1 < self.straggler_factor <= 100:
            raise JobSpecError(f"--straggler-factor {self.straggler_factor}: use more than 1 "
                               "to 100 (0 turns it off)")
        if not os.path.isabs(self.script):
            raise JobSpecError(f"script {self.script!r}: must be an absolute path")
        if not re.fullmatch(r"[0-9a-f]{64}", self.script_sha256):
            raise JobSpecError("script_sha256: not a SHA-256 hex digest")
        for k, v in self.env.items():
            if not _ENV_NAME.fullmatch(k) or not isinstance(v, str):
                raise JobSpecError(f"--env {k!r}: not a valid NAME=VALUE")
            if k.startswith(RESERVED_ENV):
                raise JobSpecError(f"--env {k}: set by elasticd or torchrun, not by a job")
        for what, path in (("--python", self.python), ("--cwd", self.cwd)):
            if not os.path.isabs(path) or "\0" in path:
                raise JobSpecError(f"{what} {path!r}: must be an absolute path")
        if "\0" in self.script or any("\0" in a for a in self.args) or \
                any("\0" in v for v in self.env.values()):
            raise JobSpecError("the script, its arguments and --env values may not hold NUL")
        if not self.user or "\0" in self.user:
            raise JobSpecError(f"--user {self.user!r}: not a user name")
        return self

    def encode(self) -> bytes:
        """The record. A learned hang timeout (None) is left out rather than written as
        null: a daemon of the release before reads a missing field as its default (a fixed
        300 s), where a null would make it refuse the job."""
        payload = dataclasses.asdict(self)
        if payload["hang_timeout"] is None:
            del payload["hang_timeout"]
        return records.encode(KIND, payload)

    @classmethod
    def decode(cls, raw: bytes, key: bytes | str = b"?", job: str | None = None) -> "JobSpec":
        """Reads a spec, checking each field's type and value.

        Args:
            job: the job its key names; the spec must name the same one.

        Raises:
            records.CorruptRecord: malformed, a bad value, or another job's name.
            records.UnsupportedRecordVersion: written by a newer elasticd.
        """
        spec = records.decode_dataclass(cls, raw, KIND, key)
        where = records.where_of(key)
        if job is not None and spec.name != job:
            raise records.CorruptRecord(f"{where}: the spec names job {spec.name[:70]!r}, its "
                                        f"key {job!r}")
        try:
            spec.check_fields()
        except JobSpecError as exc:
            raise records.CorruptRecord(f"{where}: {exc}") from None
        return spec

    def torchrun_nnodes(self) -> str:
        return f"{self.nnodes_min}:{self.nnodes_max}"


def build(name: str, nnodes: str, nproc_per_node: int, script: str, args: list[str],
          user: str | None = None, cwd: str | None = None, env: list[str] | None = None,
          python: str | None = None, **fields: Any) -> JobSpec:
    """Builds and validates a spec from ``elasticctl submit`` arguments; ``fields`` are
    :class:`JobSpec` fields taken as they are (``max_restarts``, ``hang_timeout``, ...), with
    JobSpec's defaults."""
    lo, hi = parse_nnodes(nnodes)
    script_abs = os.path.abspath(script)
    if not os.path.isfile(script_abs):
        raise JobSpecError(f"script {script!r}: no such file")
    me = pwd.getpwuid(os.getuid()).pw_name
    if user is None:
        if os.getuid() == 0:
            raise JobSpecError("submitting as root: name the user the job runs as with --user "
                               "(--user root if you really mean it)")
        user = me
    envd: dict[str, str] = {}
    for item in env or []:
        k, sep, v = item.partition("=")
        if not sep:
            raise JobSpecError(f"--env {item!r}: expected NAME=VALUE")
        envd[k] = v
    return JobSpec(
        name=name, nnodes_min=lo, nnodes_max=hi, nproc_per_node=nproc_per_node,
        script=script_abs, args=list(args), script_sha256=sha256_file(script_abs), user=user,
        cwd=os.path.abspath(cwd or os.getcwd()), env=envd, python=python or sys.executable,
        created_at=SYSTEM_CLOCK.wall(), **fields).validate()


class JobState(records.ValueEnum):
    """A node's state of one job (:attr:`NodeJobStatus.state`), and what a job's control wants
    (:attr:`JobControl.desired`: RUNNING, STOPPED or FAILED).

    On a node: IDLE (no job yet; with a ``waiting: …`` detail while the job's files are not on
    the node yet) → RUNNING | REFUSED; REFUSED → RUNNING when its spec or control changes
    (``elasticctl retry``); RUNNING → RESTARTING (its agent died,
    started again after a backoff) → RUNNING | SUCCEEDED | FAILED (succeeded or failed
    elsewhere meanwhile); RUNNING → STOPPING → STOPPED | SUCCEEDED | FAILED | DRAINED |
    REFUSED; RUNNING → STOPPED at once when the node fences itself or the daemon shuts down.
    STARTING is read, never written by this version. A member is its string (JSON, comparisons,
    formatting), so records read and print as they did when states were plain strings.
    """

    IDLE = "idle"
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REFUSED = "refused"
    DRAINED = "drained"


@dataclasses.dataclass(frozen=True)
class JobControl:
    """The desired state of a job: ``running`` or ``stopped`` (written by ``elasticctl``), or
    ``failed`` (written by a daemon that found the job crash-looping; ``reason`` says why)."""

    desired: JobState
    at: float
    by: str = ""
    reason: str = ""

    KIND = "job_control"

    def encode(self) -> bytes:
        return records.encode_dataclass(self.KIND, self)

    #: What ``desired`` may say; anything else is a malformed record (ignored), not a stop.
    DESIRED = (JobState.RUNNING, JobState.STOPPED, JobState.FAILED)

    @classmethod
    def decode(cls, raw: bytes, key: bytes | str = b"?") -> "JobControl":
        """Raises: records.RecordError (malformed, or an unknown desired state)."""
        control = records.decode_dataclass(cls, raw, cls.KIND, key)
        if control.desired not in cls.DESIRED:
            raise records.CorruptRecord(f"{records.where_of(key)}: unknown desired state "
                                        f"{control.desired[:40]!r}")
        return dataclasses.replace(control, desired=JobState(control.desired))


@dataclasses.dataclass(frozen=True)
class NodeJobStatus:
    """One node's view of one job, under ``jobs/<job>/nodes/<node>`` (bound to its lease).

    state: a :class:`JobState` (DRAINED: the node was drained, ``elasticctl drain``).
    """

    node: str
    state: JobState
    detail: str = ""
    agent_pid: int = 0
    agent_starts: int = 0
    worker_restarts: int = 0
    world_size: int = 0
    last_step: int = -1
    log: str = ""
    at: float = 0.0
    ranks: list[int] = dataclasses.field(default_factory=list)  # this node's global ranks
    unprotected: str = ""  # "UNPROTECTED: <why>" while a node failure would lose too much
    hang_timeout: float = 0.0  # the hang timeout in force (0: none: off, or no job running)
    hang_timeout_source: str = ""  # set | learned | floor | first_step (cluster/learned_timeout.py)
    compute_seconds: float = 0.0  # compute time per step outside collectives (0: not measured)
    straggler: str = ""  # "STRAGGLER: <why>" while named a straggler (agent/straggler.py)

    KIND = "node_job_status"

    def encode(self) -> bytes:
        return records.encode_dataclass(self.KIND, self)

    @classmethod
    def decode(cls, raw: bytes, key: bytes | str = b"?",
               node: str | None = None) -> "NodeJobStatus":
        """Reads a node's job status; with ``node`` (the node its key names), the status must
        be about that node."""
        st = records.decode_dataclass(cls, raw, cls.KIND, key)
        if st.state not in list(JobState):
            raise records.CorruptRecord(f"{records.where_of(key)}: unknown job state "
                                        f"{st.state[:40]!r}")
        if node is not None and st.node != node:
            raise records.CorruptRecord(f"{records.where_of(key)}: the status names node "
                                        f"{st.node[:70]!r}, its key {node!r}")
        return dataclasses.replace(st, state=JobState(st.state))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

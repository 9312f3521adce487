"""Runs one torchrun elastic agent for one job on this node, and makes sure nothing outlives it.

The agent runs in a session of its own. torchrun puts each worker in a session of its own too,
so signalling the agent's process group does not reach the workers, and a killed agent leaves
its workers training (docs/facts.md). Every process started here therefore carries a tag in its
environment (``ELASTICD_TAG``), inherited by the workers and anything they start; stopping means
SIGTERM to the agent's group and to every tagged process, a grace period, then SIGKILL to
whatever still carries the tag. Tagged processes are found by scanning ``/proc``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import secrets
import signal
import subprocess
from typing import Sequence

from elasticd.agent import safe_open
from elasticd.agent.job_files import open_job_log
from elasticd.agent.job_rules import PEER_FAILED_SIGNAL
from elasticd.agent.zygote import ZYGOTE_ENV, ZYGOTE_PID_ENV, kill_group
from elasticd.clock import Clock, SystemClock, format_local
from elasticd.cluster.jobspec import JobSpec
from elasticd.local.job_scope import TAG_ENV, JobScope, start_time, stat_fields

log = logging.getLogger(__name__)

#: Set for the agent of a job in in-process mode (:mod:`elasticd.agent.in_process_agent`).
IN_PROCESS_ENV = "ELASTICD_IN_PROCESS"
#: The job's ``reform_deadline`` (seconds), for the agent of an in-process job.
REFORM_DEADLINE_ENV = "ELASTICD_REFORM_DEADLINE"

# ``python -m MODULE ARGS`` without the working directory on sys.path, as ``-P`` does on Python
# 3.11+, but for any Python a job names: the job's working directory is not the daemon's to
# trust, and a torch/ planted there must not run in the agent or the zygote. (-c puts "" first
# on sys.path; it is dropped before anything is imported.) Not inherited: torchrun starts each
# worker as a new interpreter, whose script directory comes first on sys.path as usual.
_SAFE_MODULE = ("import sys; del sys.path[0]; del sys.argv[0]; import runpy; "
                "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def safe_module(python: str, module: str, *args: str) -> list[str]:
    """argv that runs ``module`` as ``python -m`` would, with the working directory off
    sys.path."""
    return [python, "-c", _SAFE_MODULE, module, *args]


#: Bytes of a process's environment read when looking for its tag. Any local user's process
#: can point its environment at gigabytes of empty memory (``prctl(PR_SET_MM_MAP)``) and make a
#: whole read take minutes and as much of the daemon's memory; every process the daemon
#: starts has its tag first (:meth:`AgentSupervisor.env`), so the head is enough.
ENV_READ_LIMIT = 128 << 10


def tagged_pids(tag: str = "", prefix: str = "") -> list[int]:
    """PIDs of live processes whose environment has ``ELASTICD_TAG=<tag>`` (or a tag starting
    with ``prefix``), looked for in the first :data:`ENV_READ_LIMIT` bytes of each."""
    needle = f"{TAG_ENV}={tag or prefix}".encode()
    out = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb", buffering=0) as fh:
                env = fh.read(ENV_READ_LIMIT)
        except OSError:
            continue  # gone, or not ours to read
        if not process_runs(int(name)):
            continue  # a zombie runs nothing; its parent reaps it
        entries = env.split(b"\0")[:-1] if len(env) == ENV_READ_LIMIT else env.split(b"\0")
        if (needle in entries) if tag else any(e.startswith(needle) for e in entries):
            out.append(int(name))
    return out


def process_runs(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    state = stat_fields(pid)[:1]
    return bool(state) and state[0] not in (b"Z", b"X")


def signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_workers(pids: Sequence[int]) -> None:
    """SIGKILLs torchrun workers and whatever they started: each is a session leader, so its
    process group holds its children."""
    for pid in pids:
        kill_group(pid)


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (of its main thread, which starts torchrun's workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


class AgentSupervisor:
    """One torchrun agent for ``spec`` on this node.

    Args:
        tag: value of ``ELASTICD_TAG`` for everything started for this job on this node.
        etcd: ``HOST:PORT,...`` for the agent's rendezvous.
        prefix: cluster key prefix (the rendezvous lives under ``<prefix>/jobs/<job>/rdzv``).
        log_dir: where the agent's log (with its workers' output) and torchrun's files go.
        extra_env: more environment for the agent and workers (the daemon's socket, ...).
        rdzv_conf: torchrun ``--rdzv-conf`` entries.
        warm: start a zygote beside the agent and have torchrun hand each worker to it
            (:mod:`elasticd.agent.zygote`: no torch import on the recovery path).
    """

    def __init__(self, spec: JobSpec, node_id: str, tag: str, etcd: str, prefix: str,
                 log_dir: str, extra_env: dict[str, str] | None = None,
                 rdzv_conf: dict[str, str] | None = None, warm: bool = False,
                 clock: Clock | None = None) -> None:
        self.spec = spec
        self.node_id = node_id
        self.tag = tag
        self.etcd = etcd
        self.prefix = prefix
        self.log_dir = log_dir
        self.extra_env = extra_env or {}
        self.rdzv_conf = rdzv_conf or {}
        self.clock = clock or SystemClock()
        self.proc: subprocess.Popen | None = None
        self.zygote: subprocess.Popen | None = None
        self.warm = warm
        self.starts = 0
        self.zygote_name = ""  # a fresh unguessable name per start (see start())
        self.uid = -1  # the job's uid, once started
        # agent.log as this supervisor opened it, for reading: the log's directory is the job
        # user's, so the log is never opened again by its path (docs/security.md).
        self._log_fd = -1
        self._starts: dict[int, int] = {}  # pid -> start time of the agent and the zygote

    @property
    def log_path(self) -> str:
        return os.path.join(self.log_dir, "agent.log")

    def argv(self) -> list[str]:
        s = self.spec
        conf = {"key_prefix": self.prefix, **self.rdzv_conf}
        return safe_module(
            s.python, "elasticd.agent.torchrun",  # torch.distributed.run, plus a node's duties
            "--nnodes", s.torchrun_nnodes(),
            "--nproc-per-node", str(s.nproc_per_node),
            "--rdzv-backend", "etcd-v3",
            "--rdzv-endpoint", self.etcd,
            "--rdzv-id", s.name,
            "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()),
            "--max-restarts", str(s.max_restarts),
            # In-process mode: the agent learns that a member is gone when it asks the
            # rendezvous (num_nodes_waiting, once a monitor interval), and its workers wait.
            "--monitor-interval", "0.02" if s.in_process else "0.1",
            "--log-dir", os.path.join(self.log_dir, "torchrun"),
            # "--" before the training script: torchrun's parser otherwise takes a script
            # argument that abbreviates one of its own options (--log, --node, --max...) for
            # that option and refuses the launch ("ambiguous option"; plain torchrun does).
            *(["--module", "--", "elasticd.agent.warm_start"] if self.warm else ["--"]),
            s.script, *s.args,
        )

    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("ELASTICD_", "TORCHELASTIC_", "NOTIFY_SOCKET"))}
        user = pwd.getpwnam(self.spec.user)
        env = {**base, "HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name,
               **self.spec.env, **self.extra_env,
               "ELASTICD_NODE": self.node_id, "ELASTICD_JOB": self.spec.name,
               # Workers must not reuse the rank-0 agent's TCPStore on restarts (docs/facts.md).
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1",
               **({ZYGOTE_ENV: self.zygote_name} if self.warm else {}),
               **({IN_PROCESS_ENV: "1", REFORM_DEADLINE_ENV: repr(self.spec.reform_deadline),
                   # Every node of a job runs nproc_per_node workers of one role: torch's
                   # agent then computes the ranks (group_rank * nproc_per_node + local rank,
                   # what its store exchange gives too) instead of two rounds of store
                   # requests to etcd per re-formation.
                   "TORCH_ELASTIC_WORKER_IDENTICAL": "1"} if self.spec.in_process else {})}
        env.pop(TAG_ENV, None)
        # The tag first: tagged_pids reads only the head of an environment.
        return {TAG_ENV: self.tag, **env}

    def start(self) -> int:
        """Starts the agent; returns its pid.

        Raises:
            OSError: the log directory or its ``agent.log`` cannot be opened safely.
        """
        user = pwd.getpwnam(self.spec.user)
        self.uid = user.pw_uid
        as_other = user.pw_uid != os.getuid()
        fd = open_job_log(self.log_dir, "agent.log", user.pw_uid if as_other else None,
                          user.pw_gid)
        self._close_log()
        # The very file just opened (checked: a regular file with one link), for reading.
        self._log_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        with os.fdopen(fd, "ab") as out:
            out.write(f"\n==== elasticd: starting agent for {self.spec.name} on {self.node_id} "
                      f"at {format_local(self.clock.wall())} ====\n".encode())
            out.flush()
            self.zygote_name = secrets.token_hex(16) if self.warm else ""
            env = self.env()
            popen = dict(stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         cwd=self.spec.cwd, env=env, start_new_session=True,
                         user=user.pw_uid if as_other else None,
                         group=user.pw_gid if as_other else None,
                         extra_groups=[] if as_other else None)
            if self.warm:  # first: it imports torch while torchrun does its rendezvous
                # The name travels in the environment (readable by the job's user and root
                # only), never in argv, which every local user can read.
                self.zygote = subprocess.Popen(
                    safe_module(self.spec.python, "elasticd.agent.zygote"), **popen)
                env[ZYGOTE_PID_ENV] = str(self.zygote.pid)  # the agent's env: the same dict
            self.proc = subprocess.Popen(self.argv(), **popen)
        self._starts = {p.pid: start_time(p.pid) for p in (self.proc, self.zygote) if p}
        self.starts += 1
        log.info("started torchrun agent for %s (pid %d, log %s)", self.spec.name,
                 self.proc.pid, self.log_path)
        return self.proc.pid

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def scope(self) -> JobScope | None:
        """The job as the daemon's local socket admits it (None before the agent starts)."""
        if self.proc is None:
            return None
        return JobScope(job=self.spec.name, uid=self.uid, roots=dict(self._starts),
                        world_max=self.spec.nnodes_max * self.spec.nproc_per_node)

    def log_size(self) -> int:
        """The size of the agent's log (0 if unknown), from the descriptor opened at start."""
        try:
            return os.fstat(self._log_fd).st_size if self._log_fd >= 0 else 0
        except OSError:
            return 0

    def log_tail(self, start: int, limit: int = 65536) -> str:
        """What the agent's log holds from byte ``start`` on, at most its last ``limit`` bytes,
        read from the descriptor opened at start (never from the path, which the job's user
        may have replaced with a FIFO or a link to any file)."""
        if self._log_fd < 0:
            return ""
        return safe_open.read_tail(self._log_fd, start, limit).decode(errors="replace")

    def _close_log(self) -> None:
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1

    def poll(self) -> int | None:
        """None while the agent runs, else its exit status (negative: killed by a signal)."""
        return None if self.proc is None else self.proc.poll()

    def worker_pids(self) -> list[int]:
        """The agent's worker processes (its direct children)."""
        return children(self.pid) if self.poll() is None else []

    def tell_peer_failed(self) -> None:
        """Tells the agent of an in-process job that a peer of its round failed (a signal,
        :data:`job_rules.PEER_FAILED_SIGNAL`): it re-forms now, not when the rendezvous'
        summary reaches it through etcd."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, PEER_FAILED_SIGNAL)

    def restart_workers(self, reason: str) -> int:
        """Kills the current workers so that the agent restarts them in a new rendezvous
        round (proactive abort: waiting for gloo/NCCL to time out takes minutes)."""
        pids = self.worker_pids()
        log.warning("restarting workers of %s (%s): SIGKILL to %s", self.spec.name, reason, pids)
        kill_workers(pids)
        return len(pids)

    def stop(self, grace: float = 10.0) -> int | None:
        """Stops the agent and every tagged process: SIGTERM, ``grace`` seconds, SIGKILL.

        Returns:
            the agent's exit status, if it had one.
        """
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        signal_all(tagged_pids(self.tag), signal.SIGTERM)
        self.clock.wait(lambda: ((self.proc is None or self.proc.poll() is not None)
                                 and not tagged_pids(self.tag)), grace)
        left = tagged_pids(self.tag)
        if left:
            log.warning("SIGKILL to %d processes of %s still running after %.0f s",
                        len(left), self.spec.name, grace)
            if self.proc is not None and self.proc.poll() is None:
                kill_group(self.proc.pid)
            signal_all(left, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        # Reap-wait for the SIGKILLed (they are not our children: poll /proc).
        self.clock.wait(lambda: not tagged_pids(self.tag), 5)
        if self.zygote is not None:  # our child: reap it
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.zygote.wait(timeout=1)
        self._close_log()
        return self.proc.poll() if self.proc is not None else None

"""Starting a job's torchrun agent on this node: its etcd credentials, its environment, its tag.

A start that cannot be made (no credentials for it, an interpreter the job's user may not run)
is the job's problem, returned as a sentence for its refusal; the daemon goes on. etcd trouble
while issuing credentials is raised: the start is tried again at the next cycle.
"""

from __future__ import annotations

import os
import subprocess
from typing import Callable

from elasticd.agent.supervisor import AgentSupervisor
from elasticd.clock import Clock
from elasticd.cluster.jobspec import JobSpec
from elasticd.coordination.api import AuthError, CoordinationError

#: Extra rendezvous settings and environment that give an agent its own etcd credentials.
Credentials = tuple[dict[str, str], dict[str, str]]


class AgentStarter:
    """Makes and starts job agents (owned by the job manager).

    Args:
        state_dir: where per-job logs go (``<state_dir>/jobs/<job>/agent.log``).
        extra_env: returns more environment for agents (e.g. the daemon's local socket).
        warm: start workers from a zygote (:mod:`elasticd.agent.zygote`).
        credentials: called with a job's spec before its agent starts; returns the
            :data:`Credentials` of its agent (:mod:`elasticd.coordination.agent_credentials`),
            or raises to refuse the start; None: agents use the daemon's.
    """

    def __init__(self, node_id: str, prefix: str, etcd: str, state_dir: str,
                 extra_env: Callable[[], dict[str, str]], warm: bool, clock: Clock,
                 credentials: Callable[[JobSpec], Credentials] | None) -> None:
        self._node_id = node_id
        self._prefix = prefix
        self._etcd = etcd
        self._state_dir = state_dir
        self._extra_env = extra_env
        self._warm = warm
        self._clock = clock
        self._credentials = credentials
        # Part of every job's process tag: the tag finds a job's processes through /proc, and
        # an agent that fences SIGKILLs every process with its tag. Without this token, an
        # agent of an earlier daemon of the same prefix, node and job (a daemon restarted
        # under systemd, or the previous cluster on a test host) fencing late would kill
        # this daemon's agent and workers too.
        self._incarnation = os.urandom(4).hex()

    def log_dir(self, job: str) -> str:
        return os.path.join(self._state_dir, "jobs", job)

    def credentials(self, spec: JobSpec) -> Credentials | str:
        """The credentials of ``spec``'s agent, or why it cannot have them.

        Raises:
            CoordinationError: etcd trouble (not the job's problem: tried again).
        """
        if self._credentials is None:
            return {}, {}
        try:
            return self._credentials(spec)
        except AuthError as exc:
            return (f"cannot give its agent etcd credentials ({exc}): the daemons' etcd "
                    "user needs etcd's root role, or set agent_etcd_users = off")
        except CoordinationError:
            raise
        except Exception as exc:  # noqa: BLE001 — whatever the spec holds, refuse, not crash
            return f"cannot check the job on this node: {exc}"

    def start(self, job: str, spec: JobSpec, rdzv_conf: dict[str, str],
              credentials: Credentials) -> AgentSupervisor | str:
        """Starts ``job``'s agent; returns it, or why it could not start."""
        extra_conf, extra_env = credentials
        supervisor = AgentSupervisor(
            spec, self._node_id, tag=f"{self._prefix}:{self._node_id}:{job}:{self._incarnation}",
            etcd=self._etcd, prefix=self._prefix, log_dir=self.log_dir(job),
            extra_env={**self._extra_env(), **extra_env},
            rdzv_conf={**rdzv_conf, **extra_conf}, warm=self._warm, clock=self._clock)
        try:
            supervisor.start()
        except (OSError, subprocess.SubprocessError) as exc:
            # e.g. the job's user may not run the interpreter after all (PermissionError
            # from exec): this job cannot run here.
            supervisor.stop(grace=1.0)
            return f"cannot start its agent: {exc}"
        return supervisor

"""Starting a job's agent (elasticd/agent/agent_start.py) alone: what it is given, and a start
that cannot be made coming back as the job's problem. The real start of a real agent:
tests/integration/test_torchrun_native.py."""

from __future__ import annotations

import sys

import pytest

from elasticd.agent.agent_start import AgentStarter
from elasticd.agent.supervisor import AgentSupervisor
from elasticd.cluster.jobspec import JobSpec
from elasticd.coordination.api import AuthError, CoordinationError
from elasticd.testing.clock import FakeClock

SPEC = JobSpec(name="job", nnodes_min=1, nnodes_max=1, nproc_per_node=1,
               script=sys.executable, args=[], script_sha256="0" * 64, user="root", cwd="/")


def starter(tmp_path, credentials=None) -> AgentStarter:
    return AgentStarter("n1", "/p", "127.0.0.1:1", str(tmp_path), lambda: {"A": "daemon"},
                        warm=False, clock=FakeClock(), credentials=credentials)


def test_without_credentials_of_its_own_an_agent_uses_the_daemons(tmp_path):
    assert starter(tmp_path).credentials(SPEC) == ({}, {})


def test_credentials_that_cannot_be_issued_refuse_the_job_but_etcd_trouble_is_raised(tmp_path):
    def issue(error):
        def credentials(spec):
            raise error
        return credentials

    why = starter(tmp_path, issue(AuthError("permission denied"))).credentials(SPEC)
    assert why.startswith("cannot give its agent etcd credentials (permission denied)")
    assert "agent_etcd_users = off" in why
    why = starter(tmp_path, issue(ValueError("bad name"))).credentials(SPEC)
    assert why == "cannot check the job on this node: bad name"
    with pytest.raises(CoordinationError):
        starter(tmp_path, issue(CoordinationError("etcd down"))).credentials(SPEC)


def test_an_agent_gets_its_credentials_the_daemons_env_and_a_tag_of_this_daemon(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setattr(AgentSupervisor, "start", lambda self: 4242)
    a = starter(tmp_path).start("job", SPEC, {"join_timeout": "9"},
                                ({"user": "agent"}, {"B": "agent"}))
    assert isinstance(a, AgentSupervisor)
    assert a.rdzv_conf == {"join_timeout": "9", "user": "agent"}
    assert a.extra_env == {"A": "daemon", "B": "agent"}
    assert a.log_dir == str(tmp_path / "jobs" / "job")
    assert a.tag.startswith("/p:n1:job:")
    b = starter(tmp_path).start("job", SPEC, {}, ({}, {}))
    assert b.tag != a.tag  # another daemon's agents of the same job: another tag


def test_an_agent_that_cannot_start_is_the_jobs_problem_and_its_leftovers_go(tmp_path,
                                                                             monkeypatch):
    stopped = []

    def start(self):
        raise PermissionError("exec denied")

    monkeypatch.setattr(AgentSupervisor, "start", start)
    monkeypatch.setattr(AgentSupervisor, "stop", lambda self, grace=0: stopped.append(grace))
    why = starter(tmp_path).start("job", SPEC, {}, ({}, {}))
    assert why == "cannot start its agent: exec denied" and stopped == [1.0]

"""A job's files checked as its user, off the main loop, with a deadline (issue 26, finding 1;
against real daemons: tests/integration/test_daemon_not_blocked.py).

Real helper processes running as a user the test creates (CI runs as root: nothing skips);
the deadline and the record of hung checks with a check that the test holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import threading

import pytest

from elasticd.agent import job_check
from elasticd.agent.job_check import JobChecks, Verdict, check_job
from elasticd.agent.job_holds import JobHolds
from elasticd.agent.manager import JobManager
from elasticd.cluster.job_policy import JobPolicy
from elasticd.testing.clock import FakeClock
from elasticd.cluster.jobspec import JobControl, JobSpec
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator
from elasticd.launcher import reachable
from elasticd.metrics import Metrics
from tests.hostile_files import sparse_file
from tests.users import temporary_user

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user: needs root "
                               "(CI is)")
KEYS = Keyspace("/t")


@pytest.fixture(scope="module")
def job_user():
    if os.geteuid() != 0:
        yield None
        return
    with temporary_user("edc") as user:
        yield user


@pytest.fixture
def place(tmp_path):
    reachable(str(tmp_path))
    os.chmod(tmp_path, 0o755)
    good = tmp_path / "train.py"
    good.write_text("print('training')\n")
    good.chmod(0o644)
    return tmp_path


def spec_for(place, user, script, sha=None, **over) -> JobSpec:
    if sha is None:
        with open(script, "rb") as fh:
            sha = hashlib.sha256(fh.read()).hexdigest()
    fields = dict(name="job", nnodes_min=1, nnodes_max=1, nproc_per_node=1, script=str(script),
                  args=[], script_sha256=sha, user=user, cwd=str(place))
    return JobSpec(**{**fields, **over})


@root_only
def test_a_plain_script_passes_and_hostile_ones_are_refused_with_one_line(place, job_user):
    user = job_user.pw_name
    assert check_job(spec_for(place, user, place / "train.py"), JobPolicy()) == Verdict()
    fifo = place / "fifo.py"
    os.mkfifo(fifo)
    os.chmod(fifo, 0o644)
    link = place / "link.py"
    link.symlink_to("/proc/self/pagemap")
    huge = sparse_file(str(place / "huge.py"), 64 << 30)
    private = place / "private.py"
    private.write_text("x = 1\n")
    private.chmod(0o600)
    cases = {
        "/proc/self/pagemap": "on a proc file system",  # the helper's own: a regular file
        str(fifo): "is a FIFO, not a regular file",
        str(link): "is a symbolic link, not a regular file",
        huge: "68719476736 bytes, more than",
        str(private): f"user {user} cannot read the script",
        "/dev/zero": "is a character device",
        "/etc/hostname\n/x": "is not on this node",
    }
    for script, needle in cases.items():
        verdict = check_job(spec_for(place, user, script, sha="0" * 64), JobPolicy())
        assert needle in verdict.problem, (script, verdict)
        assert "\n" not in verdict.problem and verdict.waiting == (needle == "is not on this node")
    other = spec_for(place, user, place / "train.py", sha="0" * 64)
    assert "differs on this node" in check_job(other, JobPolicy()).problem
    nocwd = spec_for(place, user, place / "train.py", cwd=str(place / "later"))
    assert check_job(nocwd, JobPolicy()).waiting


@root_only
def test_the_interpreter_is_run_as_the_job_user_who_must_be_able_to(place, job_user):
    private = place / "private"
    private.mkdir(mode=0o700)
    python = str(private / "python")
    shutil.copy(sys.executable, python)
    verdict = check_job(spec_for(place, job_user.pw_name, place / "train.py", python=python),
                        JobPolicy(python=python))
    assert verdict.problem.startswith(
        f"user {job_user.pw_name} cannot execute the interpreter {python}: it cannot enter "
        f"{private} (mode 0700, owner root); install the environment")


def test_a_check_that_hangs_is_refused_remembered_and_not_run_again_after_a_restart(tmp_path):
    clock = FakeClock(100.0)
    release, calls = threading.Event(), []

    def stuck(spec, policy, deadline):
        calls.append(spec.name)
        release.wait(30)
        return Verdict()

    spec = spec_for(tmp_path, "nobody", __file__)
    control = JobControl("running", 1.0, "elasticctl")
    checks = JobChecks(str(tmp_path), clock, check=stuck)
    try:
        assert checks.verdict("job", spec, control, JobPolicy(), wait=0.01) is None
        assert calls == ["job"]  # the check runs, off the caller's thread
        clock.advance(checks.deadline + 3)
        verdict = checks.verdict("job", spec, control, JobPolicy(), wait=0.01)
        assert verdict.hung and "took more than 10 s" in verdict.problem
        assert "until its spec changes or an operator retries (elasticctl retry job)" in \
            verdict.problem
        # A restarted daemon does not run it again: refused at once, with the same reason.
        again = JobChecks(str(tmp_path), clock, check=stuck)
        assert again.verdict("job", spec, control, JobPolicy(), wait=0) == verdict
        assert calls == ["job"]
        # An operator's retry (a new control) or a new spec is checked afresh.
        retried = dataclasses.replace(control, at=2.0, by="elasticctl retry")
        assert again.verdict("job", spec, retried, JobPolicy(), wait=0.01) is None
        assert calls == ["job", "job"]
    finally:
        release.set()


def test_a_check_that_answers_in_time_is_not_remembered(tmp_path):
    checks = JobChecks(str(tmp_path), FakeClock(), check=lambda s, p, d: Verdict("no"))
    spec = spec_for(tmp_path, "nobody", __file__)
    assert checks.verdict("job", spec, None, JobPolicy()) == Verdict("no")
    assert not os.path.exists(tmp_path / job_check.HUNG_FILE)


def manager(coord, clock, tmp_path) -> JobManager:
    lease = coord.grant_lease(10)
    return JobManager("n1", coord, KEYS, etcd="x:1", state_dir=str(tmp_path), metrics=Metrics(),
                      lease=lambda: lease, clock=clock, policy=JobPolicy(users=("*",)))


def test_a_refused_job_is_checked_again_only_when_its_records_change(tmp_path):
    """Refused until the spec or the control changes (elasticctl retry), not at every cycle
    and not for ever; a script not deployed yet waits, and the job starts once it is."""
    coord, clock = MemoryCoordinator(), FakeClock(10.0)
    mgr = manager(coord, clock, tmp_path)
    seen: list[str] = []
    answers = {"first": Verdict("script '/x' differs on this node"),
               "retried": Verdict("script '/x' is not on this node", waiting=True)}

    def check(spec, policy, deadline):
        control = mgr.records.controls.get("job")
        seen.append(control.by)
        return answers[control.by]

    mgr.checks = JobChecks(str(tmp_path), clock, check=check)
    coord.put(KEYS.job_keys("job").spec, spec_for(tmp_path, "root", __file__).encode())
    coord.put(KEYS.job_keys("job").control, JobControl("running", 1.0, "first").encode())
    mgr.records.start_watch()
    try:
        for _ in range(3):
            mgr.step()
        assert mgr.board.status.state == "refused" and "differs" in mgr.board.status.detail
        assert seen == ["first"] and mgr.wanted() is None
        coord.put(KEYS.job_keys("job").control, JobControl("running", 2.0, "retried").encode())
        for _ in range(3):
            mgr.step()
        assert seen == ["first", "retried"]  # checked again once, then waits for the retry
        assert mgr.board.status.state == "idle" and mgr.board.status.detail.startswith("waiting: ")
        clock.advance(job_check.WAIT_RETRY + 0.1)
        mgr.step()
        assert seen == ["first", "retried", "retried"]
        coord.put(KEYS.job_keys("job").control, JobControl("stopped", 3.0, "elasticctl").encode())
        mgr.step()
        assert mgr.board.status.state == "stopped" and "no longer wanted" in mgr.board.status.detail
    finally:
        mgr.records.close()


def test_a_job_waiting_for_its_files_holds_no_newer_job(tmp_path, monkeypatch):
    """A script that never comes must not keep the node from every later job: the waiting job
    is looked at again only while nothing else runs."""
    started: list[str] = []
    monkeypatch.setattr("elasticd.agent.supervisor.AgentSupervisor.start",
                        lambda self: started.append(self.spec.name) or 4242)
    monkeypatch.setattr("elasticd.agent.supervisor.AgentSupervisor.poll", lambda self: None)
    monkeypatch.setattr("elasticd.agent.supervisor.AgentSupervisor.stop",
                        lambda self, grace=0: 0)
    coord, clock = MemoryCoordinator(), FakeClock(10.0)
    mgr = manager(coord, clock, tmp_path)
    checked: list[str] = []

    def check(spec, policy, deadline):
        checked.append(spec.name)
        return Verdict("not there", waiting=True) if spec.name == "a" else Verdict()

    mgr.checks = JobChecks(str(tmp_path), clock, check=check)
    for name in ("a", "b"):
        spec = spec_for(tmp_path, "root", __file__, name=name)
        coord.put(KEYS.job_keys(name).spec, spec.encode())
    mgr.records.start_watch()
    try:
        mgr.step()
        assert checked == ["a"] and mgr.wanted() == "b"
        mgr.step()
        assert started == ["b"] and mgr.job == "b"
        clock.advance(job_check.WAIT_RETRY + 1)
        mgr.step()
        assert mgr.job == "b" and checked == ["a", "b"]  # a waits while b runs
    finally:
        mgr.records.close()


def test_holds_last_while_the_records_do():
    holds = JobHolds()
    holds.refuse("a", ("spec1", "control1"))
    assert holds.held("a", ("spec1", "control1"), now=0.0, busy=False)
    assert not holds.held("a", ("spec1", "control2"), now=0.0, busy=False)  # a retry
    assert not holds.held("a", ("spec1", "control1"), now=0.0, busy=False)  # dropped with it
    holds.wait("b", ("spec", None), until=5.0)
    assert holds.held("b", ("spec", None), now=1.0, busy=False)
    assert not holds.held("b", ("spec", None), now=6.0, busy=False)  # time to look again
    assert holds.held("b", ("spec", None), now=6.0, busy=True)  # unless another job runs
    assert holds.end_waits(lambda job: False) == ["b"] and holds.waiting == {}

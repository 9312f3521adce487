"""The daemon's socket as a non-root job meets it: the job's processes are admitted, each bound
to its job and rank; other uids, other programs of the job's user and leftovers of another job
are not (issue 13, finding 7).

Real sockets, a real server and real client processes running as users the test creates (CI
runs as root: nothing here skips).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

import pytest

from elasticd.daemon.local_api import LocalServer
from elasticd.daemon.local_binding import CallerBinding
from elasticd.local.job_scope import JobScope, start_time
from tests.users import temporary_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users: needs root (CI is)")

# Connects once told to on stdin, runs the requests in argv[1] on one connection, prints what
# each returned.
CLIENT = r"""
import json, sys
from elasticd.worker.client import DaemonClient, DaemonClientError
sys.stdin.readline()
c = DaemonClient(sys.argv[2], timeout=5)
for op, fields in json.loads(sys.argv[1]):
    try:
        if fields.pop("_oneway", False):
            c.send(op, **fields)
            print(json.dumps({"sent": op}), flush=True)
            continue
        print(json.dumps({"ok": c.call(op, **fields)}), flush=True)
    except DaemonClientError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
"""


class Handlers:
    """Records what reached the daemon's handlers."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def _note(self, op: str):
        def handle(msg: dict) -> dict:
            with self.lock:
                self.seen.append((op, {k: v for k, v in msg.items() if k not in ("id",)}))
            if op in ("ckpt_open", "ckpt_fetch"):
                return {"pin": 7}
            return {"job": msg.get("job")}
        return handle

    def table(self) -> dict:
        return {op: self._note(op) for op in ("ckpt_reserve", "ckpt_complete", "ckpt_report",
                                              "ckpt_list", "ckpt_open", "ckpt_fetch",
                                              "ckpt_release", "ckpt_committed", "progress",
                                              "ping", "ckpt_sessions",
                                              "ckpt_sessions_done")}

    def ops(self) -> list[tuple[str, object, object]]:
        with self.lock:
            return [(op, m.get("job"), m.get("rank")) for op, m in self.seen]


@pytest.fixture(scope="module")
def users():
    with temporary_user("edj") as job_user, temporary_user("edh") as hostile:
        yield job_user, hostile


@pytest.fixture
def daemon(users):
    """A server with a binding whose running job (``scope["now"]``) the test sets."""
    sockdir = tempfile.mkdtemp(prefix="edbind-")
    os.chmod(sockdir, 0o711)
    scope: dict[str, JobScope | None] = {"now": None}
    handlers = Handlers()
    server = LocalServer(os.path.join(sockdir, "d.sock"), handlers.table(),
                         binding=CallerBinding(lambda: scope["now"]))
    server.start()
    try:
        yield server, scope, handlers
    finally:
        server.stop()
        os.rmdir(sockdir)


def start_client(server, user, requests, tag: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    if tag is not None:
        env["ELASTICD_TAG"] = tag
    return subprocess.Popen([sys.executable, "-c", CLIENT, json.dumps(requests), server.path],
                            user=user.pw_uid, group=user.pw_gid, extra_groups=[], env=env,
                            cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate("go\n", timeout=30)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def scope_of(job: str, user, roots, recycled: bool = False) -> JobScope:
    """The job's scope with ``roots`` as its agent and zygote (``recycled``: as if each root's
    pid had been reused by a later process since the daemon started it)."""
    return JobScope(job=job, uid=user.pw_uid,
                    roots={pid: start_time(pid) - (1 if recycled else 0) for pid in roots})


def test_a_job_process_writes_only_its_own_rank_and_reads_only_its_own_job(daemon, users):
    server, scope, handlers = daemon
    job_user, _ = users
    proc = start_client(server, job_user, [
        ["ckpt_reserve", {"job": "a", "rank": 0, "world_size": 2, "nbytes": 8}],
        ["ckpt_reserve", {"job": "a", "rank": 1, "world_size": 2, "nbytes": 8}],
        ["ckpt_complete", {"job": "a", "rank": 1, "ticket": 1, "header_size": 8}],
        ["ckpt_report", {"job": "a", "rank": 1, "source": "local"}],
        ["progress", {"job": "a", "rank": 1, "step": 3, "_oneway": True}],
        ["ckpt_reserve", {"job": "b", "rank": 0, "world_size": 2, "nbytes": 8}],
        ["ckpt_open", {"job": "b", "rank": 0, "generation": 0, "step": 1}],
        ["ckpt_list", {}],
        ["ckpt_open", {"job": "a", "rank": 1, "generation": 0, "step": 1}],
        ["ckpt_release", {"pin": 8}],
        ["ckpt_release", {"pin": 7}],
        ["progress", {"job": "a", "rank": 0, "step": 4}],
    ], tag="/p:n1:a")
    scope["now"] = scope_of("a", job_user, [proc.pid])
    replies = finish(proc)
    errors = [r.get("error", "") for r in replies]
    assert "ok" in replies[0], replies[0]
    assert "writes for rank 0" in errors[1] and "writes for rank 0" in errors[2]
    assert "writes for rank 0" in errors[3]
    assert "belongs to job a" in errors[5] and "belongs to job a" in errors[6]
    assert replies[7] == {"ok": {"job": "a"}}  # a request naming no job is given its own
    assert replies[8] == {"ok": {"pin": 7}}  # any rank of its own job: restores after a resize
    assert "was not given to this connection" in errors[9]
    assert "ok" in replies[10] and "ok" in replies[11]
    assert handlers.ops() == [("ckpt_reserve", "a", 0), ("ckpt_list", "a", None),
                              ("ckpt_open", "a", 1), ("ckpt_release", "a", None),
                              ("progress", "a", 0)]


def test_a_job_process_is_handed_sessions_to_its_own_jobs_holders_only(daemon, users):
    """``ckpt_sessions`` (replication sessions handed to a worker) is held to the caller's job
    like every read; another uid is not admitted at all (the test below)."""
    server, scope, handlers = daemon
    job_user, _ = users
    proc = start_client(server, job_user, [
        ["ckpt_sessions", {"job": "b", "rank": 0, "old_rank": 1, "generation": 0, "step": 1}],
        ["ckpt_sessions", {"job": "a", "rank": 0, "old_rank": 1, "generation": 0, "step": 1}],
        ["ckpt_sessions", {"job": "a", "rank": 1, "old_rank": 1, "generation": 0, "step": 1}],
        ["ckpt_sessions_done", {"job": "a", "rank": 1, "old_ranks": [1]}],
        ["ckpt_sessions_done", {"job": "a", "rank": 0, "old_ranks": [1]}],
    ], tag="/p:n1:a")
    scope["now"] = scope_of("a", job_user, [proc.pid])
    replies = finish(proc)
    assert "belongs to job a" in replies[0].get("error", ""), replies[0]
    assert replies[1] == {"ok": {"job": "a"}}
    # Bound to the rank it first asked for: no sets for other ranks against the holders' caps.
    assert "writes for rank 0" in replies[2].get("error", ""), replies[2]
    # Nor can it end another rank's sets.
    assert "writes for rank 0" in replies[3].get("error", ""), replies[3]
    assert replies[4] == {"ok": {"job": "a"}}
    assert handlers.ops() == [("ckpt_sessions", "a", 0), ("ckpt_sessions_done", "a", 0)]


@pytest.mark.parametrize("who", ["other uid", "job uid, a recycled pid of the job's agent",
                                 "job uid, tagged, outside the job's process tree",
                                 "another job's process"])
def test_only_the_running_jobs_processes_are_admitted(daemon, users, who):
    server, scope, handlers = daemon
    job_user, hostile = users
    user = hostile if who == "other uid" else job_user
    tag = {"another job's process": "/p:n1:b"}.get(who, "/p:n1:a")
    proc = start_client(server, user, [
        ["ckpt_reserve", {"job": "a", "rank": 0, "world_size": 1, "nbytes": 8}],
        ["ckpt_open", {"job": "a", "rank": 0, "generation": 0, "step": 1}],
        ["ckpt_list", {"job": "a"}],
    ], tag=tag)
    inside = who in ("other uid", "job uid, a recycled pid of the job's agent")
    elsewhere = subprocess.Popen(["sleep", "60"])  # the job's agent, not the client's parent
    try:
        scope["now"] = scope_of("a", job_user, [proc.pid] if inside else [elsewhere.pid],
                                recycled=who.endswith("agent"))
        replies = finish(proc)
    finally:
        elsewhere.kill()
        elsewhere.wait()
    assert all("may not use this elasticd" in r.get("error", "")
               or "is not a process of job a" in r.get("error", "") for r in replies), replies
    assert handlers.ops() == []


def test_a_connection_of_an_ended_job_is_refused_once_another_runs(daemon, users):
    server, scope, handlers = daemon
    job_user, _ = users
    proc = start_client(server, job_user, [
        ["ckpt_list", {"job": "a"}],
        ["ckpt_reserve", {"job": "a", "rank": 0, "world_size": 1, "nbytes": 8}],
    ], tag="/p:n1:a")
    scope["now"] = scope_of("a", job_user, [proc.pid])
    ran_b = threading.Event()

    def switch(msg: dict) -> dict:  # job a ends and job b starts after the first request
        scope["now"] = scope_of("b", job_user, [1])
        ran_b.set()
        return {}

    server._handlers["ckpt_list"] = switch
    replies = finish(proc)
    assert ran_b.is_set() and "ok" in replies[0]
    assert "job a no longer runs on this node" in replies[1]["error"]
    assert handlers.ops() == []


def test_the_daemons_own_uid_outside_a_job_is_not_bound(daemon):
    server, scope, handlers = daemon
    from elasticd.worker.client import DaemonClient

    scope["now"] = None
    client = DaemonClient(server.path)
    try:
        assert client.call("ckpt_list", job="anything") == {"job": "anything"}
    finally:
        client.close()

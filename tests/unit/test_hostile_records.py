"""Records written by a hostile etcd writer, on the in-memory coordinator: the daemon survives
every one, refuses what it cannot run with the reason, and is not fooled by key names.

Each test reproduces an attack that ended or misled the daemon before records were decoded
with type checks (issue 13, findings 2, 9 and 12)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys

import pytest

from elasticd.agent.manager import JobManager
from elasticd.cluster.job_policy import JobPolicy
from elasticd.testing.clock import FakeClock
from elasticd.cluster.events import EventLog
from elasticd.cluster.jobspec import JobSpec, NodeJobStatus, sha256_file
from elasticd.config import Settings
from elasticd.coordination import records
from elasticd.coordination.keys import Keyspace, check_name
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.daemon.daemon import Daemon
from elasticd.launcher import reachable
from elasticd.metrics import Metrics

KEYS = Keyspace("/elasticd")
TRAIN = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train.py")


@pytest.fixture
def world(tmp_path):
    clock = FakeClock()
    store = MemoryStore(clock)
    daemons = {}

    def start(node, **kw):
        s = Settings(node_id=node, etcd="mem:1", lease_ttl=2, loop_interval=0.25,
                     state_dir=str(tmp_path / node), **kw)
        d = Daemon(s, MemoryCoordinator(store), clock=clock)
        d.registration.http_address = f"{node}:1"  # as node.py sets it once serving
        d.join(keep_alive_thread=False)
        daemons[node] = d
        return d

    def tick(seconds=0.25):
        clock.advance(seconds)
        for d in daemons.values():
            d.keeper.step()
        store.expire_leases()
        return {n: d.cycle() for n, d in daemons.items()}

    yield store, start, tick, daemons
    for d in daemons.values():
        d.jobs.shutdown()
        d.close()


def node_body(node="n9", **over):
    body = {"schema": 1, "record": "node", "node": node, "state": "up", "address": "a:1",
            "hostname": "h", "pid": 1, "incarnation": "x", "started_at": 1.0,
            "heartbeat_at": 1.0, "version": "0", "lease": 0}
    body.update(over)
    return json.dumps(body).encode()


def spec(tmp_path, **over):
    fields = dict(name="job", nnodes_min=1, nnodes_max=1, nproc_per_node=1,
                  script=os.path.abspath(TRAIN), args=[], script_sha256=sha256_file(TRAIN),
                  user="nobody", cwd=str(tmp_path), python=sys.executable)
    fields.update(over)
    return JobSpec(**fields)


def test_a_node_record_with_a_bad_heartbeat_is_ignored_and_its_deletion_survived(world, caplog):
    store, start, tick, daemons = world
    start("n1")
    coord = MemoryCoordinator(store)
    lease = coord.grant_lease(2)
    coord.put(KEYS.node("n9"), node_body(heartbeat_at="soon"), lease)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            tick()
        daemons["n1"]._resync(daemons["n1"].clock.monotonic())  # re-reads it: no new warning
        coord.revoke_lease(lease)  # deleted: on main, TypeError in the failure's detection time
        for _ in range(3):
            sentence = tick()["n1"]
    assert "n9" not in daemons["n1"].membership.nodes
    assert "cycle failed" not in sentence
    warned = [r for r in caplog.records if "heartbeat_at" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert EventLog(coord, KEYS).list() and not [
        e for e in EventLog(coord, KEYS).list() if e.kind == "failed"]


@pytest.mark.parametrize("bad", [{"nnodes_min": "1"}, {"hang_timeout": float("nan")},
                                 {"nnodes_max": True}, {"env": {"A": 1}}, {"args": "x"},
                                 {"name": "other"}])
def test_a_malformed_spec_refuses_its_job_with_the_reason(world, tmp_path, bad):
    store, start, tick, daemons = world
    d = start("n1")
    body = json.loads(spec(tmp_path).encode())
    body.update(bad)
    MemoryCoordinator(store).put(KEYS.job_keys("job").spec,
                                 json.dumps(body, allow_nan=True).encode())
    for _ in range(3):
        tick()  # on main: TypeError out of the cycle (the daemon exits 1, again on restart)
    st = NodeJobStatus.decode(MemoryCoordinator(store).get(KEYS.job_keys("job").node("n1")).value)
    assert st.state == "refused" and "unreadable job spec" in st.detail
    assert "job" in d.status()["job"]["refused_specs"]
    assert d.jobs.supervisor is None


def test_the_running_jobs_spec_corrupted_refuses_it(world, tmp_path, monkeypatch):
    store, start, tick, daemons = world
    d = start("n1", job_users="*")
    started = []
    monkeypatch.setattr("elasticd.agent.supervisor.AgentSupervisor.start",
                        lambda self: started.append(self) or 4242)
    monkeypatch.setattr("elasticd.agent.supervisor.AgentSupervisor.poll", lambda self: None)
    monkeypatch.setattr("elasticd.agent.supervisor.AgentSupervisor.stop",
                        lambda self, grace=0: 0)
    coord = MemoryCoordinator(store)
    coord.put(KEYS.job_keys("job").spec, spec(tmp_path, user="root").encode())
    tick()
    assert started and d.jobs.job == "job"
    coord.put(KEYS.job_keys("job").spec, b'{"schema":1,"record":"job_spec","name":"job"}')
    for _ in range(4):
        tick()
    if d.jobs._stopping is not None:
        d.jobs._stopping.join(5)
    tick()
    st = NodeJobStatus.decode(coord.get(KEYS.job_keys("job").node("n1")).value)
    assert st.state == "refused" and "unreadable job spec" in st.detail
    assert d.jobs.job is None


def test_a_key_that_is_no_job_name_is_no_job(world, tmp_path):
    store, start, tick, daemons = world
    d = start("n1")
    raw = spec(tmp_path, name="job").encode()
    coord = MemoryCoordinator(store)
    for key in (b"/elasticd/jobs/../spec", b"/elasticd/jobs/j\n/spec", b"/elasticd/jobs//spec"):
        coord.put(key, raw)
    before = os.stat(d.settings.state_path) if os.path.exists(d.settings.state_path) else None
    for _ in range(3):
        tick()
    assert d.jobs.records.specs == {} and d.jobs.records.bad_specs == {}
    assert not coord.get_prefix(KEYS.jobs + b"..")[0][1:]  # no status published under ..
    if before is not None:  # on main the state directory itself was given to the job's user
        assert os.stat(d.settings.state_path).st_uid == before.st_uid


def test_a_record_under_another_nodes_key_cannot_fail_that_node(world):
    store, start, tick, daemons = world
    for n in ("n1", "n2"):
        start(n)
    tick()
    n1_lease = daemons["n1"].registered_lease
    coord = MemoryCoordinator(store)
    lease = coord.grant_lease(2)
    coord.put(KEYS.node("n1x"), node_body("n1", lease=n1_lease), lease)
    tick()
    assert daemons["n2"].membership.nodes["n1"].lease == n1_lease
    coord.revoke_lease(lease)
    for _ in range(3):
        tick()
    failed = [e for e in EventLog(coord, KEYS).list() if e.kind == "failed"]
    assert failed == []  # on main: a failure of n1 recorded against n1's live lease
    assert "n1" in daemons["n2"].membership.nodes


def test_a_status_under_another_nodes_key_is_ignored(tmp_path):
    coord = MemoryCoordinator()
    lease = coord.grant_lease(10)
    mgr = JobManager("n1", coord, KEYS, etcd="x:1", state_dir=str(tmp_path), metrics=Metrics(),
                     lease=lambda: lease, clock=FakeClock())
    coord.put(KEYS.job_keys("job").spec, spec(tmp_path).encode())
    coord.put(KEYS.job_keys("job").node("n2"), NodeJobStatus("n3", "succeeded").encode(), lease)
    mgr.records.start_watch()
    assert mgr.records.statuses.get("job", {}) == {} and mgr.records.succeeded_on("job", "n1") == []


@pytest.mark.parametrize("name", ["n1\n", "j\n", "a/b", "..", "", "x" * 64, "é"])
def test_names_are_matched_whole(name):
    with pytest.raises(ValueError):
        check_name("node id", name)


def test_non_finite_numbers_and_wrong_types_are_refused():
    for raw in (b'{"schema":1,"record":"node","x":NaN}', b'{"schema":1,"record":"node","x":-Infinity}',
                b'{"schema":true,"record":"node"}', b"[" * 100_000):
        with pytest.raises(records.CorruptRecord):
            records.decode(raw, "node")
    from elasticd.cluster.membership import NodeRecord

    for over in ({"pid": 1.5}, {"pid": True}, {"heartbeat_at": 1e400}, {"lease": -1},
                 {"replication": "host:port"}, {"sentence": 3}):
        with pytest.raises(records.CorruptRecord):
            NodeRecord.decode(node_body(**over), b"k")


@pytest.mark.parametrize("over,needle", [
    ({"user": "root"}, "runs as root"),
    ({"python": "/bin/sh"}, "interpreter '/bin/sh'"),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "--env LD_PRELOAD is refused"),
    ({"env": {"PYTHONPATH": "/tmp"}}, "--env PYTHONPATH is refused"),
    ({"env": {"BASH_ENV": "/tmp/x"}}, "--env BASH_ENV is refused"),
])
def test_the_node_policy_refuses_what_etcd_asks_for(tmp_path, over, needle):
    problem = JobPolicy().check(spec(tmp_path, **over))
    assert problem is not None and needle in problem
    loose = JobPolicy(users=("*",), python=over.get("python", sys.executable),
                      env_allow=("LD_*", "PYTHON*", "BASH_ENV"))
    assert loose.check(spec(tmp_path, **over)) is None  # allowed only by the node's settings


def test_the_node_policy_from_settings():
    from elasticd.config import ConfigError, load

    s = load({"node_id": "n1", "job_users": "nobody", "job_env_allow": "PYTHONHASHSEED"},
             environ={})
    p = s.job_policy()
    assert p.users == ("nobody",) and p.python == sys.executable
    assert p.env_allow == ("PYTHONHASHSEED",)
    for bad, needle in ((("job_users", "no-such-user-x"), "no such user"),
                        (("job_python", "python3"), "absolute path"),
                        (("job_env_allow", "LD_$"), "pattern"),
                        (("agent_etcd_users", "maybe"), "auto, on or off"),
                        (("agent_etcd_cert", "/nonexistent.pem"), "together")):
        with pytest.raises(ConfigError, match=needle):
            load({"node_id": "n1", bad[0]: bad[1]}, environ={})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (CI is root)")
def test_an_interpreter_the_job_user_cannot_run_refuses_the_job(tmp_path):
    """Root passes every access check: the check runs as the job's user. On main the X_OK
    check passed as root and Popen's PermissionError ended the daemon."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    python = str(private / "python")
    shutil.copy("/bin/true", python)
    os.chmod(python, 0o755)
    work = tmp_path / "work"
    work.mkdir(mode=0o755)
    reachable(str(tmp_path))  # pytest makes its run directory 0700: only `private` is closed
    coord = MemoryCoordinator()
    lease = coord.grant_lease(10)
    mgr = JobManager("n1", coord, KEYS, etcd="x:1", state_dir=str(tmp_path / "state"),
                     metrics=Metrics(), lease=lambda: lease, clock=FakeClock(),
                     policy=JobPolicy(python=python))
    script = tmp_path / "train.py"
    shutil.copy(TRAIN, script)
    os.chmod(script, 0o644)
    coord.put(KEYS.job_keys("job").spec, spec(tmp_path, python=python, cwd=str(work),
                                         script=str(script)).encode())
    mgr.records.start_watch()
    mgr.step()
    assert mgr.supervisor is None
    assert mgr.board.status.state == "refused"
    assert "nobody cannot execute the interpreter" in mgr.board.status.detail
    # ...and why, and what to do: the directory that stops it, and where to put a venv.
    assert f"it cannot enter {private} (mode 0700, owner root)" in mgr.board.status.detail
    assert "job_python" in mgr.board.status.detail and "--python" in mgr.board.status.detail
    mgr.records.close()


def test_every_value_the_etcd_fuzz_writes_is_refused_by_its_decoder():
    """bench/fuzz_etcd.py must write malformed records only: an odd but well-formed one is a
    request (a drain, a stop), not an attack on the decoder."""
    import importlib.util
    import random

    from elasticd.cluster.drain_record import DrainRecord
    from elasticd.cluster.events import Event
    from elasticd.cluster.membership import NodeRecord
    from elasticd.cluster.jobspec import JobControl
    from elasticd.replication import election
    from elasticd.replication.commit import decode_ahead, decode_committed
    from elasticd.replication.fences import decode_fence
    from elasticd.replication.placement import decode_placement

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "fuzz_etcd.py")
    mod_spec = importlib.util.spec_from_file_location("fuzz_etcd", path)
    fuzz = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(fuzz)
    decoders = {
        "node": lambda raw: NodeRecord.decode(raw, b"k", "n1"),
        "job_spec": lambda raw: JobSpec.decode(raw, b"k", "j"),
        "job_control": lambda raw: JobControl.decode(raw, b"k"),
        "node_job_status": lambda raw: NodeJobStatus.decode(raw, b"k", "n1"),
        "drain": lambda raw: DrainRecord.decode(raw, b"k", "n1"),
        "placement": lambda raw: decode_placement(raw, b"k"),
        "ckpt_committed": lambda raw: decode_committed(raw, b"k"),
        "ckpt_coordinator": lambda raw: election.decode(raw, b"k"),
        "ckpt_ahead": lambda raw: decode_ahead(raw, b"k"),
        "ckpt_fence": lambda raw: decode_fence(raw, b"k"),
        "event": lambda raw: records.decode_dataclass(Event, raw, "event", b"k"),
    }
    bodies = fuzz.templates(["n1", "n2", "n3"])
    for kind, decode in decoders.items():
        if decode is None:
            continue
        decode(records.encode(kind, bodies[kind]))  # the template itself reads
        rng = random.Random(kind)
        for _ in range(300):
            raw = fuzz.malformed(rng, kind, bodies[kind], "n2")
            with pytest.raises(records.RecordError):
                decode(raw)


def test_elasticctl_jobs_shows_a_refused_job_and_why(tmp_path):
    from elasticd.cli.jobs import cmd_jobs

    coord = MemoryCoordinator()
    lease = coord.grant_lease(10)
    body = json.loads(spec(tmp_path, name="bad").encode())
    body["nnodes_min"] = "1"
    coord.put(KEYS.job_keys("bad").spec, json.dumps(body).encode())
    coord.put(KEYS.job_keys("root").spec, spec(tmp_path, name="root", user="root").encode())
    coord.put(KEYS.job_keys("root").node("n1"), NodeJobStatus("n1", "refused", JobPolicy().check(
        spec(tmp_path, user="root"))).encode(), lease)
    rows = {r["job"]: r for r in cmd_jobs(None, coord, KEYS)}
    assert rows["bad"]["running_on"].startswith("refused: unreadable job spec")
    assert "nnodes_min" in rows["bad"]["refused"]
    assert rows["root"]["running_on"].startswith("refused on n1: runs as root")

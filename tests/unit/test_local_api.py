"""The local channel over real Unix sockets: framing, one-way messages, failures, credentials,
start-up checks, concurrency, and the worker client (environment, reconnects, timeouts)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc

import pytest

import elasticd.worker
from elasticd.agent.progress import ProgressTracker, progress_handler
from elasticd.testing.clock import FakeClock
from elasticd.daemon import local_api
from elasticd.daemon.local_api import LocalServer, SocketInUse, UnsafeSocketPath
from elasticd.local.wire import RequestError
from elasticd.worker import (
    DaemonClient,
    DaemonError,
    DaemonTimeout,
    DaemonUnavailable,
    WorkerIdentity,
)

LEN = struct.Struct("!I")


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


class Recorder:
    """Handlers for the tests; remembers what one-way messages arrived."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.lock = threading.Lock()

    def handlers(self) -> dict:
        return {
            "echo": lambda m: {k: v for k, v in m.items() if k not in ("op", "id")},
            "whoami": lambda m: {"peer": m["_peer"]},
            "boom": self._boom,
            "refuse": self._refuse,
            "record": self._record,
            "slow": lambda m: time.sleep(m["seconds"]) or {"slept": m["seconds"]},
            "bad": lambda m: ["not", "a", "dict"],
        }

    def _boom(self, m):
        raise RuntimeError("kaboom")

    def _refuse(self, m):
        raise RequestError("no slot for rank 3: over the memory cap")

    def _record(self, m):
        with self.lock:
            self.records.append(m)


@pytest.fixture
def sockdir():
    # Short on purpose: a Unix socket path holds at most 107 bytes, pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="ed-la-")
    yield d
    leftovers = os.listdir(d)
    shutil.rmtree(d)
    assert leftovers == [], f"left behind: {leftovers}"


@pytest.fixture
def rec():
    return Recorder()


@pytest.fixture
def servers():
    started: list[LocalServer] = []
    yield started
    for s in started:
        s.stop()


@pytest.fixture
def make_server(sockdir, rec, servers):
    def make(name: str = "d.sock", **kwargs) -> LocalServer:
        kwargs.setdefault("handlers", rec.handlers())
        s = LocalServer(os.path.join(sockdir, name), **kwargs)
        s.start()
        servers.append(s)
        return s
    return make


@pytest.fixture
def server(make_server):
    return make_server()


@pytest.fixture
def clients():
    made: list[DaemonClient] = []
    yield made
    for c in made:
        c.close()


@pytest.fixture
def client(server, clients):
    c = DaemonClient(server.path, timeout=5.0)
    clients.append(c)
    return c


def open_connections(server: LocalServer) -> int:
    with server._lock:
        return len(server._conns)


def raw(server: LocalServer) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5.0)
    s.connect(server.path)
    return s


def frame(obj) -> bytes:
    body = json.dumps(obj).encode()
    return LEN.pack(len(body)) + body


def read_frame(s: socket.socket):
    head = recv_exact(s, 4)
    if not head:
        return None
    (n,) = LEN.unpack(head)
    return json.loads(recv_exact(s, n))


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return buf
        buf += chunk
    return buf


def assert_closed(s: socket.socket) -> None:
    assert s.recv(1) == b""
    s.close()


# -- framing and replies ---------------------------------------------------------------------

def test_round_trip_on_the_wire(server):
    s = raw(server)
    s.sendall(frame({"op": "echo", "id": 7, "x": [1, 2], "s": "é"}))
    reply = read_frame(s)
    assert reply["id"] == 7 and reply["ok"] is True
    assert reply["x"] == [1, 2] and reply["s"] == "é"
    assert reply["_peer"]["pid"] == os.getpid()
    s.close()


def test_client_call_returns_the_handlers_fields(client):
    assert client.call("echo", n=3, nested={"a": None}) == {
        "n": 3, "nested": {"a": None},
        "_peer": {"pid": os.getpid(), "uid": os.geteuid(), "gid": os.getegid()}}


def test_one_way_messages_get_no_reply(server, rec):
    s = raw(server)
    s.sendall(frame({"op": "record", "noreply": True, "n": 1}))  # no id needed
    s.sendall(frame({"op": "boom", "id": 1, "noreply": True}))  # its failure is not answered
    s.sendall(frame({"op": "echo", "id": 2}))
    assert read_frame(s)["id"] == 2  # the first frame back answers the call
    assert [r["n"] for r in rec.records] == [1]
    s.close()


def test_client_send_is_delivered_in_order_before_a_later_call(client, rec):
    for i in range(100):
        assert client.send("record", i=i) is True
    client.call("echo")  # same connection, served in order: every send is handled by now
    assert [r["i"] for r in rec.records] == list(range(100))
    assert client.dropped == 0


def test_handler_exception_is_an_error_reply_and_the_server_goes_on(client, caplog):
    with caplog.at_level(logging.ERROR, logger="elasticd.daemon.local_api"):
        with pytest.raises(DaemonError, match="boom failed in the daemon: RuntimeError: kaboom"):
            client.call("boom")
    assert "kaboom" in caplog.text  # logged with its traceback
    assert client.call("echo", ok_after=True)["ok_after"] is True


def test_request_error_passes_its_message(client):
    with pytest.raises(DaemonError) as info:
        client.call("refuse")
    assert info.value.op == "refuse"
    assert info.value.error == "no slot for rank 3: over the memory cap"


def test_unknown_op_and_non_dict_result_are_errors(client):
    with pytest.raises(DaemonError, match="unknown op 'nope'; this daemon serves bad, boom"):
        client.call("nope")
    with pytest.raises(DaemonError, match="handler returned a list"):
        client.call("bad")
    assert client.call("echo") is not None


# -- bad frames ------------------------------------------------------------------------------

def test_malformed_json_gets_an_error_then_the_connection_closes(server, client):
    s = raw(server)
    s.sendall(LEN.pack(5) + b"{nope")
    reply = read_frame(s)
    assert reply["id"] is None and reply["ok"] is False
    assert "not valid JSON" in reply["error"] and "closing" in reply["error"]
    assert_closed(s)
    assert client.call("echo", alive=1)["alive"] == 1


@pytest.mark.parametrize("body", [b"[1, 2]", b"\xff\xfe", b"[" * 100_000])
def test_non_object_and_invalid_utf8_and_deep_json(server, body):
    s = raw(server)
    s.sendall(LEN.pack(len(body)) + body)
    reply = read_frame(s)
    assert reply["ok"] is False and reply["id"] is None
    assert_closed(s)


def test_requests_without_op_or_id_close_the_connection(server):
    for bad in ({"id": 1}, {"op": "echo"}, {"op": "echo", "id": "1"}, {"op": "echo", "id": True},
                {"op": "echo", "id": 1, "noreply": "yes"}):
        s = raw(server)
        s.sendall(frame(bad))
        reply = read_frame(s)
        assert reply["ok"] is False and '"op" (a string)' in reply["error"]
        assert_closed(s)


def test_oversized_length_is_refused_without_allocating_it(server, client):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        s = raw(server)
        s.sendall(LEN.pack(0xFFFF_FFFF))  # claims 4 GiB and sends nothing more
        reply = read_frame(s)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reply["ok"] is False and "4294967295 bytes is over the limit of 1048576" in \
        reply["error"]
    assert_closed(s)
    assert peak < 4 << 20
    assert client.call("echo", alive=1)["alive"] == 1


def test_max_message_is_exact(make_server, monkeypatch):
    monkeypatch.setattr(local_api, "DEFAULT_MAX_MESSAGE", 100)
    server = make_server()
    s = raw(server)
    body = json.dumps({"op": "echo", "id": 1, "pad": ""}).encode()
    fits = body.replace(b'""', b'"' + b"x" * (100 - len(body)) + b'"')
    assert len(fits) == 100
    s.sendall(LEN.pack(100) + fits)
    assert read_frame(s)["ok"] is True
    s.sendall(LEN.pack(101) + fits + b" ")
    assert "101 bytes is over the limit of 100" in read_frame(s)["error"]
    assert_closed(s)


def test_empty_frame_is_refused(server):
    s = raw(server)
    s.sendall(LEN.pack(0))
    assert "empty frame" in read_frame(s)["error"]
    assert_closed(s)


@pytest.mark.parametrize("data", [LEN.pack(100) + b"0123456789", b"\x00\x00"])
def test_truncated_frame_closes_the_connection(server, client, data):
    s = raw(server)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    assert_closed(s)  # nothing to answer: the peer is gone mid-frame
    assert client.call("echo", alive=1)["alive"] == 1


# -- credentials and start-up ----------------------------------------------------------------

def test_peer_credentials_come_from_the_kernel(client):
    me = {"pid": os.getpid(), "uid": os.geteuid(), "gid": os.getegid()}
    assert client.call("whoami")["peer"] == me
    # Whatever a client claims is replaced.
    assert client.call("whoami", _peer={"pid": 1, "uid": 0, "gid": 0})["peer"] == me


def test_worker_in_another_process_is_light_and_identified(server):
    code = (
        "import os, sys\n"
        "import elasticd.worker\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'prometheus_client', 'elasticd.store',"
        " 'elasticd.coordination', 'elasticd.worker.checkpointer') if m in sys.modules)\n"
        "c = elasticd.worker.DaemonClient.from_env()\n"
        "print(os.getpid(), c.call('whoami')['peer']['pid'], heavy)\n"
    )
    env = dict(os.environ, ELASTICD_SOCKET=server.path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split(maxsplit=2)
    assert out[0] == out[1] and out[1] != str(os.getpid())
    assert out[2].strip() == "[]"


def test_daemon_side_does_not_import_torch():
    code = ("import sys, elasticd.daemon.local_api, elasticd.agent.progress\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "False"


def test_socket_is_private(server, sockdir):
    st = os.stat(server.path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()


def test_stop_unlinks_the_socket_and_closes_connections(server, client):
    assert client.call("echo") is not None
    s = raw(server)
    server.stop()
    assert not os.path.exists(server.path)
    assert_closed(s)
    assert open_connections(server) == 0
    with pytest.raises(DaemonUnavailable, match="the daemon is gone"):
        client.call("echo")
    server.stop()  # idempotent


def test_stale_socket_file_is_replaced(sockdir, make_server):
    path = os.path.join(sockdir, "d.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens: what a kill -9 of the daemon leaves
    server = make_server()
    with DaemonClient(path) as c:
        assert c.call("echo", fine=1)["fine"] == 1
    assert server.path == path


def test_live_socket_of_another_process_is_not_taken_over(server, sockdir, rec):
    second = LocalServer(server.path, rec.handlers())
    with pytest.raises(SocketInUse, match=rf"served by a live process \(pid {os.getpid()}"):
        second.start()
    assert os.path.exists(server.path)
    with DaemonClient(server.path) as c:
        assert c.call("echo", still=1)["still"] == 1


def test_a_file_that_is_not_a_socket_is_left_alone(sockdir, rec):
    path = os.path.join(sockdir, "d.sock")
    open(path, "w").close()
    with pytest.raises(UnsafeSocketPath, match="not a socket"):
        LocalServer(path, rec.handlers()).start()
    os.unlink(path)


def test_a_directory_others_can_write_is_refused(sockdir, rec):
    os.chmod(sockdir, 0o777)
    try:
        with pytest.raises(UnsafeSocketPath, match="writable by others"):
            LocalServer(os.path.join(sockdir, "d.sock"), rec.handlers()).start()
    finally:
        os.chmod(sockdir, 0o700)


def test_missing_directory_is_created_traversable_not_writable(sockdir, make_server):
    server = make_server(name="run/d.sock")
    assert stat.S_IMODE(os.stat(os.path.dirname(server.path)).st_mode) & 0o022 == 0
    server.stop()
    os.rmdir(os.path.dirname(server.path))


def test_too_long_path_is_a_clear_error(rec):
    with pytest.raises(ValueError, match="longer than the 107 bytes"):
        LocalServer("/tmp/" + "x" * 120, rec.handlers())


def test_connection_cap(make_server, clients, monkeypatch):
    monkeypatch.setattr(local_api, "MAX_CONNECTIONS", 2)
    server = make_server()
    first, second, third = (DaemonClient(server.path) for _ in range(3))
    clients.extend([first, second, third])
    first.call("echo")
    second.call("echo")
    with pytest.raises(DaemonError, match=r"too many connections to this elasticd \(2\)"):
        third.call("echo")
    first.close()
    wait_for(lambda: open_connections(server) == 1)
    assert third.call("echo", fine=1)["fine"] == 1


# -- concurrency -----------------------------------------------------------------------------

def test_many_clients_concurrently(server, clients):
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        c = DaemonClient(server.path)
        clients.append(c)
        try:
            for i in range(500):
                assert c.call("echo", n=n, i=i)["i"] == i
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert time.monotonic() - started < 30


def test_one_client_shared_by_threads_keeps_replies_apart(client, rec):
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(200):
                assert client.call("echo", n=n, i=i) == {
                    "n": n, "i": i, "_peer": client.call("whoami")["peer"]}
                client.send("record", n=n, i=i)
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    client.call("echo")
    assert len(rec.records) == 800 and client.dropped == 0


def test_a_started_call_is_under_way_before_its_result_is_taken(make_server, clients, rec):
    """start() sends at once (the daemon works while the caller flattens a state); result()
    gives what call() would; until then the connection is this call's: another thread's call
    waits for it, and close() frees it without a result."""
    entered, gate = threading.Event(), threading.Event()

    def gated(m):
        entered.set()
        gate.wait(5)
        return {"opened": gate.is_set()}

    server = make_server(handlers={**rec.handlers(), "gated": gated})
    client = DaemonClient(server.path, timeout=10.0)
    clients.append(client)
    pending = client.start("gated")  # returns while the handler waits for the gate
    assert entered.wait(5)  # the daemon is working on it before anyone asks for the reply
    gate.set()
    assert pending.result() == {"opened": True}  # start() did not wait for the handler
    with pytest.raises(RuntimeError, match="already taken"):
        pending.result()
    pending = client.start("echo", n=1)
    other: list = []
    thread = threading.Thread(target=lambda: other.append(client.call("echo", n=2)))
    thread.start()
    thread.join(0.2)
    assert thread.is_alive() and not other  # waits for the connection
    assert pending.result()["n"] == 1
    thread.join(5)
    assert other[0]["n"] == 2
    dropped = client.start("refuse")
    dropped.close()  # nobody takes it: read and dropped, not raised
    assert dropped._done
    with pytest.raises(DaemonError, match="over the memory cap"):
        client.start("refuse").result()
    assert client.call("echo", n=3)["n"] == 3


# -- the worker client -----------------------------------------------------------------------

def test_from_env_reads_torchrun_and_elasticd_variables():
    env = {"ELASTICD_SOCKET": "/run/elasticd/n1.sock", "ELASTICD_JOB": "llm", "RANK": "5",
           "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "2",
           "TORCHELASTIC_RESTART_COUNT": "3"}
    c = DaemonClient.from_env(env, timeout=2.5)
    assert c.path == "/run/elasticd/n1.sock" and c.timeout == 2.5
    assert c.identity == WorkerIdentity(job="llm", rank=5, local_rank=1, world_size=8,
                                        group_rank=2, restart_count=3)
    only = DaemonClient.from_env({"ELASTICD_SOCKET": "/s"})
    assert only.identity == WorkerIdentity()


def test_from_env_without_a_daemon_says_why():
    with pytest.raises(DaemonUnavailable, match="ELASTICD_SOCKET is not set"):
        DaemonClient.from_env({"RANK": "0"})
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        DaemonClient.from_env({"ELASTICD_SOCKET": "/s", "RANK": "zero"})


def test_no_daemon_call_raises_and_send_drops(sockdir, caplog):
    c = DaemonClient(os.path.join(sockdir, "nobody.sock"))
    with pytest.raises(DaemonUnavailable, match="no elasticd socket at .*gone or has not started"):
        c.call("echo")
    with caplog.at_level(logging.WARNING, logger="elasticd.worker.client"):
        assert [c.progress(i) for i in range(5)] == [False] * 5
    assert c.dropped == 5
    assert caplog.text.count("dropping one-way messages") == 1


def test_progress_without_elasticd_is_a_silent_no_op(monkeypatch, caplog):
    monkeypatch.delenv("ELASTICD_SOCKET", raising=False)
    monkeypatch.setattr(elasticd.worker, "_client", None)
    monkeypatch.setattr(elasticd.worker, "_disabled", False)
    with caplog.at_level(logging.WARNING, logger="elasticd.worker"):
        for step in range(100):
            elasticd.worker.progress(step)
    assert caplog.text.count("ELASTICD_SOCKET is not set") == 1
    assert elasticd.worker.default_client() is None


def test_progress_reaches_the_tracker(make_server, monkeypatch):
    tracker = ProgressTracker(hang_timeout=30.0, clock=FakeClock())
    server = make_server(handlers={"progress": progress_handler(tracker)})
    for name, value in {"ELASTICD_SOCKET": server.path, "ELASTICD_JOB": "j", "RANK": "3",
                        "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(elasticd.worker, "_client", None)
    monkeypatch.setattr(elasticd.worker, "_disabled", False)
    try:
        for step in range(10):
            elasticd.worker.progress(step)
        wait_for(lambda: tracker.status("j")["last_step"] == 9)
        assert tracker.status("j")["ranks"][0]["rank"] == 3
        assert tracker.status("j")["ranks"][0]["pid"] == os.getpid()
    finally:
        elasticd.worker.default_client().close()


def test_client_survives_a_daemon_restart(make_server, client, server, rec):
    assert client.call("echo", n=1)["n"] == 1
    server.stop()
    make_server()  # same path, new daemon
    assert client.call("echo", n=2)["n"] == 2  # reconnected once, transparently
    assert client.call("whoami")["peer"]["pid"] == os.getpid()


def test_one_way_send_after_a_restart_is_not_lost(make_server, client, server, rec):
    assert client.send("record", n=1)
    client.call("echo")
    server.stop()
    make_server()
    assert client.send("record", n=2)
    client.call("echo")
    assert [r["n"] for r in rec.records] == [1, 2] and client.dropped == 0


def test_call_timeout_and_the_late_reply_is_skipped(client):
    with pytest.raises(DaemonTimeout, match=r"did not answer 'slow' within 0.1 s"):
        client.call("slow", seconds=0.4, timeout=0.1)
    # The same connection: the late reply to 'slow' arrives first and is recognised as stale.
    assert client.call("echo", after=1)["after"] == 1


def test_call_rejects_noreply_and_unencodable_fields(client):
    with pytest.raises(ValueError, match="use send"):
        client.call("echo", noreply=True)
    with pytest.raises(ValueError, match="cannot be sent as JSON"):
        client.call("echo", x=object())
    with pytest.raises(ValueError, match="cannot be sent as JSON"):
        client.send("echo", x=float("nan"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_opens_its_own_connection(client):
    parent_peer = client.call("whoami")["peer"]["pid"]
    pid = os.fork()
    if pid == 0:  # the child: exit code says whether it was identified as itself
        try:
            ok = client.call("whoami")["peer"]["pid"] == os.getpid()
        except BaseException:  # noqa: BLE001
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.call("whoami")["peer"]["pid"] == parent_peer == os.getpid()


def test_a_reply_whose_caller_went_away_is_handed_to_the_undelivered_hooks(server):
    # The caller dies while its request runs (a worker killed during a long fetch): what the
    # reply carried (a read pin) must be given back by someone.
    got: list = []
    server.on_undelivered.append(lambda op, reply: got.append((op, reply)))
    s = raw(server)
    s.sendall(frame({"op": "slow", "id": 7, "seconds": 0.3}))
    s.close()
    wait_for(lambda: got)
    assert [(op, reply["slept"], reply["id"]) for op, reply in got] == [("slow", 0.3, 7)]

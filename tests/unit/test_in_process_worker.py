"""The worker link and ``@elasticd.in_process`` on real sockets and a real worker process
(issue 31): the agent's end here, in the test; a gloo worker of world 1 in a subprocess.

The whole job (3 daemons, agents, a kill -9) is tests/chaos/test_in_process.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from elasticd.agent.worker_link import LinkServer
from elasticd.local import worker_link as link

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import elasticd

    out = open(sys.argv[1], "a", buffering=1)

    @elasticd.in_process(timeout=20)
    def train(r):
        out.write(json.dumps({"pid": os.getpid(), "round": r.number, "rank": r.rank,
                              "world": r.world_size, "path": r.path,
                              "previous": r.previous_rank, "times": sorted(r.times)}) + "\\n")
        if r.path == "first" and os.environ.get("ELASTICD_LINK"):
            said = False
            while True:  # until the agent asks this worker to leave
                r.check()
                if r.collective_timeout == 5.0 and not said:  # learned: the group has it
                    import torch, torch.distributed as dist
                    backend = dist.distributed_c10d._get_default_group()._get_backend(
                        torch.device("cpu"))
                    print("group timeout", backend.options._timeout, flush=True)
                    said = True
                time.sleep(0.01)
        return "done"

    print("returned", train())
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
            "WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "t",
            "PYTHONPATH": os.getcwd(), **extra}


def _stop(proc: subprocess.Popen) -> None:
    """Kills a worker a test started, if it still runs, and reaps it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _wait(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_link_admits_a_worker_and_records_it_leaving():
    server = LinkServer()
    sock = link.connect(server.name, os.getpid())
    try:
        link.send(sock, {"op": "hello", "local_rank": 1, "pid": 1})
        _wait(lambda: server.linked() == {1}, 5)
        link.send(sock, {"op": "left", "round": 3, "clean": True, "why": "reset"})
        _wait(lambda: 1 in server.left_rounds(), 5)
        assert server.left_rounds() == {1: (3, True, "reset")}
        server.forget_left(keep_round=4)
        assert server.left_rounds() == {}
        assert server.send(1, {"op": "abort", "round": 3})
        assert link.recv(sock) == {"op": "abort", "round": 3}
        assert not server.send(0, {"op": "abort", "round": 3})  # nobody linked as rank 0
    finally:
        sock.close()
    _wait(lambda: server.linked() == set(), 5)


def test_a_worker_talks_only_to_its_agents_pid():
    server = LinkServer()
    with pytest.raises(link.Untrusted, match="not the agent"):
        link.connect(server.name, os.getpid() + 1)
    with pytest.raises(OSError):
        link.connect("no-such-link", None)


def test_another_uid_is_refused_and_later_workers_still_link(monkeypatch):
    """The link's name is visible to every local user (``/proc/net/unix``): a process of
    another uid that connects is refused before it is read, and neither it nor a caller whose
    credentials do not read stops the next worker from linking."""
    from tests.users import temporary_user

    server = LinkServer()
    hello = link.wire.encode({"op": "hello", "local_rank": 3, "pid": 1})
    hostile = textwrap.dedent(f"""
        import socket, sys
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect({link.address(server.name)!r})
        s.settimeout(5)
        try:
            s.sendall({hello!r})  # a worker's hello: never read
            print("closed" if s.recv(1) == b"" else "answered")
        except (BrokenPipeError, ConnectionResetError):  # closed before or after the hello
            print("closed")
    """)
    with temporary_user() as user:
        out = subprocess.run([sys.executable, "-c", hostile], capture_output=True, text=True,
                             timeout=30, user=user.pw_uid, group=user.pw_gid,
                             extra_groups=[])
    assert out.stdout.strip() == "closed", out.stderr
    assert server.linked() == set()
    real = link.peer_credentials
    calls = []

    def fails_once(sock):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("credentials unreadable")
        return real(sock)

    monkeypatch.setattr(link, "peer_credentials", fails_once)
    odd = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    odd.connect(link.address(server.name))
    odd.settimeout(10)
    assert odd.recv(1) == b""  # refused, closed
    odd.close()
    sock = link.connect(server.name, os.getpid())
    try:
        link.send(sock, {"op": "hello", "local_rank": 0, "pid": 1})
        _wait(lambda: server.linked() == {0}, 5)
    finally:
        sock.close()


@pytest.mark.slow
def test_the_function_is_re_entered_in_the_same_process_after_an_abort(tmp_path):
    out = tmp_path / "entries.jsonl"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    server = LinkServer()
    env = _worker_env(_free_port(), ELASTICD_LINK=server.name,
                      ELASTICD_LINK_PID=str(os.getpid()), ELASTICD_ROUND="4")
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: server.linked() == {0} and out.exists() and out.read_text())
        # The round's first steps have the decorator's timeout, then the learned one (10 ms
        # steps: the floor), set on the group and told to the agent.
        _wait(lambda: server.timeouts.get(0) == 5.0)
        server.send(0, {"op": "abort", "round": 3})  # another round's abort: not this one
        server.send(0, {"op": "abort", "round": 4})
        _wait(lambda: 0 in server.left_rounds())
        assert server.left_rounds()[0][:2] == (4, True)
        assert "Reformation" in server.left_rounds()[0][2]
        server.send(0, {"op": "assign", "env": {"MASTER_PORT": str(_free_port()),
                                                "ELASTICD_ROUND": "5"},
                        "times": {"learned": 1.0, "round_closed": 2.0, "bad": "x"}})
        output, _ = proc.communicate(timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode == 0, output
    assert "returned done" in output
    assert "group timeout 0:00:05" in output
    entries = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(e["pid"], e["round"], e["path"], e["previous"]) for e in entries] == [
        (proc.pid, 4, "first", None), (proc.pid, 5, "in-process", 0)]
    # the re-formation's moments: the agent's (numbers only), then the worker's own
    assert [e["times"] for e in entries] == [
        [], ["assigned", "group_made", "learned", "left", "round_closed"]]


def test_a_staged_worker_links_and_waits_for_its_round_before_any_group(tmp_path):
    """A newcomer's staged worker (its agent started it before joining a round, with torch's
    placeholder place): it reaches the function, links, makes no group and runs nothing until
    its ``assign``; then it enters the assigned round as a fresh worker, with its readiness
    among the moments."""
    out = tmp_path / "entries.jsonl"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    server = LinkServer()
    env = _worker_env(_free_port(), ELASTICD_LINK=server.name, RANK="-1", WORLD_SIZE="-1",
                      MASTER_ADDR="", MASTER_PORT="None", ELASTICD_LINK_PID=str(os.getpid()),
                      ELASTICD_ROUND="-1", ELASTICD_STAGED="1")
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: server.linked() == {0})
        time.sleep(0.5)  # time enough to make a group or enter the function, were it to
        assert proc.poll() is None and not out.read_text()  # opened by the script: empty
        server.send(0, {"op": "abort", "round": -1})  # no round yet: nothing to leave
        server.send(0, {"op": "assign", "times": {},
                        "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                                "RANK": "0", "WORLD_SIZE": "1", "ELASTICD_ROUND": "7"}})
        _wait(lambda: out.exists() and out.read_text())
        server.send(0, {"op": "abort", "round": 7})
        _wait(lambda: 0 in server.left_rounds())
        server.send(0, {"op": "assign", "env": {"MASTER_PORT": str(_free_port()),
                                                "ELASTICD_ROUND": "8"}, "times": {}})
        output, _ = proc.communicate(timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode == 0, output
    entries = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(e["round"], e["rank"], e["world"], e["path"]) for e in entries] == [
        (7, 0, 1, "first"), (8, 0, 1, "in-process")]
    assert entries[0]["times"] == ["assigned", "group_made", "ready"]


@pytest.mark.slow
def test_without_elasticd_the_function_runs_once_with_the_usual_group(tmp_path):
    out = tmp_path / "entries.jsonl"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(out)],
                          env=_worker_env(_free_port()), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "returned done" in done.stdout
    entries = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(e["round"], e["rank"], e["world"], e["path"]) for e in entries] == [
        (0, 0, 1, "first")]


def test_a_worker_that_could_not_close_its_groups_sockets_says_so(monkeypatch):
    """The "left" note carries whether every socket of the old group closed: the agent
    re-forms only workers that left cleanly (job_rules.reform_step) and restarts the rest."""
    from elasticd.worker import in_process

    server = LinkServer()
    for key, value in _worker_env(_free_port(), ELASTICD_ROUND="7").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ELASTICD_LINK_PID", str(os.getpid()))
    real_leave = in_process._Worker._leave
    monkeypatch.setattr(in_process._Worker, "_leave",
                        lambda self, fds: real_leave(self, fds) and False)  # one held open
    worker = in_process._Worker(server.name, "gloo", 20)
    entries = []

    def train(r):
        entries.append((r.number, r.path))
        if r.path == "first":
            raise in_process.Reformation("asked")
        return "done"

    def agent():
        _wait(lambda: 0 in server.left_rounds(), 30)
        server.send(0, {"op": "assign", "env": {"MASTER_PORT": str(_free_port()),
                                                "ELASTICD_ROUND": "8"}})

    import threading

    helper = threading.Thread(target=agent)
    helper.start()
    try:
        assert worker.run(train) == "done"
    finally:
        helper.join(30)
        worker.sock.close()
    assert server.left_rounds()[0][:2] == (7, False)
    assert entries == [(7, "first"), (8, "in-process")]


def test_a_re_entered_worker_tells_its_daemon_its_moments_over_its_shared_connection(tmp_path):
    """After making the new group the worker sends ``reform_moments`` to its node's daemon
    (the recovery timeline's in-process phases), from its kernel-checked pid, and keeps that
    connection open (a worker connection that closes is read as the worker's exit)."""
    from elasticd.daemon.local_api import LocalServer

    got: list[dict] = []
    closed: list[dict] = []
    daemon = LocalServer(str(tmp_path / "d.sock"), {"reform_moments": got.append})
    daemon.on_close.append(closed.append)
    daemon.start()
    out = tmp_path / "entries.jsonl"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    server = LinkServer()
    env = _worker_env(_free_port(), ELASTICD_LINK=server.name,
                      ELASTICD_LINK_PID=str(os.getpid()), ELASTICD_ROUND="4",
                      ELASTICD_SOCKET=daemon.path, ELASTICD_JOB="j")
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: server.linked() == {0} and out.exists() and out.read_text())
        assert got == []  # a fresh process's first entry is no re-formation
        server.send(0, {"op": "abort", "round": 4})
        _wait(lambda: 0 in server.left_rounds())
        server.send(0, {"op": "assign", "env": {"MASTER_PORT": str(_free_port()),
                                                "ELASTICD_ROUND": "5"},
                        "times": {"round_closed": 2.0}})
        _wait(lambda: got)
        assert closed == []  # its connection stays while it runs
        output, _ = proc.communicate(timeout=60)
    finally:
        _stop(proc)
        daemon.stop()
    assert proc.returncode == 0, output
    [msg] = got
    assert msg["_peer"]["pid"] == proc.pid and msg["job"] == "j"
    assert sorted(msg["times"]) == ["assigned", "group_made", "left", "round_closed"]
    assert msg["times"]["round_closed"] == 2.0


TWO_RANKS = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    import elasticd
    from elasticd.worker import in_process

    rank, mode = int(os.environ["RANK"]), sys.argv[1]
    if mode == "raise" and rank == 0:
        def hang(self, fds):  # this rank's leave never ends: its peer must not wait for it
            time.sleep(3600)
        in_process._Worker._leave = hang

    @elasticd.in_process(timeout=20)
    def train(r):
        t = torch.ones(1)
        dist.all_reduce(t)
        print("ready", flush=True)
        if mode == "raise" and rank == 0:
            raise RuntimeError("gloo: a collective broke (simulated)")
        if mode == "abort" and rank == 1:
            time.sleep(3600)  # silent, its sockets open: a frozen peer
        dist.all_reduce(t)  # rank 1 ("raise"), rank 0 ("abort"): its peer never joins

    train()
""")


def test_a_broken_or_aborted_rank_ends_its_peers_pending_collective_at_once(tmp_path):
    """The leave cascade and the silent peer (real 2-rank gloo groups, the group's timeout
    20 s). ``raise``: rank 0's round raises and its leave never ends (it hangs before
    ``destroy_process_group``); rank 1, waiting in a collective on it, still raises at once,
    because rank 0 shut its group's connections down first (before, rank 1 waited for rank 0's
    whole leave: here, its 20 s timeout). ``abort``: rank 1 is silent (sockets open, nothing
    sent, as a frozen peer) while rank 0 waits on it in a collective; the agent asks rank 0 out
    of its round and its collective ends at once, not at its timeout."""
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS)
    procs, servers = [], {}
    try:
        for mode in ("raise", "abort"):
            port = _free_port()
            for rank in (0, 1):
                servers[mode, rank] = server = LinkServer()
                env = {**_worker_env(port, ELASTICD_LINK=server.name,
                                     ELASTICD_LINK_PID=str(os.getpid()), ELASTICD_ROUND="3"),
                       "RANK": str(rank), "WORLD_SIZE": "2"}
                procs.append(subprocess.Popen([sys.executable, str(script), mode], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True))
        ready = procs[2].stdout
        assert ready is not None and ready.readline().strip() == "ready"  # abort's rank 0
        servers["abort", 0].send(0, {"op": "abort", "round": 3})
        # Both well before the groups' 20 s timeout; each left clean, on a closed connection.
        _wait(lambda: 0 in servers["raise", 1].left_rounds()
              and 0 in servers["abort", 0].left_rounds(), 15)
        for key in (("raise", 1), ("abort", 0)):
            round_, clean, why = servers[key].left_rounds()[0]
            assert (round_, clean) == (3, True), key
            assert "Connection closed" in why and "Timed out" not in why, (key, why)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_leave_walks_the_heap_only_when_a_socket_of_the_group_is_still_open(monkeypatch):
    """A full collection walks the whole heap (~60 ms in a torch worker, every survivor at the
    same moment, on the recovery's critical path): it runs only when the destroyed group's
    sockets did not close (a reference cycle holds the group), not on every leave (before:
    two per leave)."""
    import gc
    import threading

    from elasticd.worker import in_process

    server = LinkServer()
    for key, value in _worker_env(_free_port(), ELASTICD_ROUND="7").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ELASTICD_LINK_PID", str(os.getpid()))
    worker = in_process._Worker(server.name, "gloo", 20)
    collections: list[int] = []

    def counted(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    def train(r):
        first.append(len(collections))
        if r.path == "first":
            raise in_process.Reformation("asked")
        if r.number == 8:
            import torch.distributed as dist

            cycle: list = [dist.distributed_c10d._get_default_group()]
            cycle.append(cycle)  # unreachable once this frame is gone: a collection frees it
            raise in_process.Reformation("asked again")
        return "done"

    def agent():
        for round_ in (8, 9):
            _wait(lambda: round_ - 1 in {v[0] for v in server.left_rounds().values()}, 30)
            server.send(0, {"op": "assign", "env": {"MASTER_PORT": str(_free_port()),
                                                    "ELASTICD_ROUND": str(round_)}})

    first: list[int] = []
    helper = threading.Thread(target=agent)
    was = gc.isenabled()
    gc.disable()  # no automatic collection in between: every one counted is the leave's
    gc.callbacks.append(counted)
    helper.start()
    try:
        assert worker.run(train) == "done"
    finally:
        gc.callbacks.remove(counted)
        if was:
            gc.enable()
        helper.join(30)
        worker.sock.close()
    # Round 7's leave: its group freed by reference counting, no collection; round 8's: the
    # group in a cycle, one full collection, and it closed.
    assert first == [0, 0, 1], (first, collections)
    assert collections == [2]
    assert all(v[1] for v in server.left_rounds().values())


def test_a_workers_message_ends_the_agents_monitor_pause():
    """The in-process agent's monitor waits for news between two looks, not its whole poll: a
    worker's ``left`` (its group broke) is looked at at once. With an hour's poll, a pause
    that ignored the news would hang this test."""
    from elasticd.agent.in_process_agent import _Node
    from elasticd.testing.clock import FakeClock

    node = _Node(FakeClock())
    node.poll = 3600.0
    sock = link.connect(node.link.name, os.getpid())
    try:
        link.send(sock, {"op": "hello", "local_rank": 0, "pid": 1})
        _wait(node.news.is_set, 5)
        node.pause()  # the hello's news taken
        link.send(sock, {"op": "left", "round": 0, "clean": True, "why": "reset"})
        _wait(node.news.is_set, 5)
        assert 0 in node.link.left_rounds()  # recorded before the news
        node.pause()
        assert not node.news.is_set()  # taken: the next pause waits for new news
    finally:
        sock.close()
    _wait(node.news.is_set, 5)  # a worker's hang-up is news too


def test_the_daemons_word_of_a_failed_peer_makes_the_agent_re_form_at_once():
    """A daemon that decided REFORM signals its agent (job_rules.PEER_FAILED_SIGNAL): the
    agent's node is broken and its monitor woken at once, before the rendezvous' summary of
    the death reaches it through etcd (20-60 ms later: the slowest agent's learning was most
    of that phase). Not while it re-forms, nor just after: the word is of the failure it
    answers. Before, the signal was ignored (SIGWINCH's default) and nothing was broken."""
    import signal

    from elasticd.agent import in_process_agent, job_rules
    from elasticd.testing.clock import FakeClock

    node = in_process_agent._Node(FakeClock())
    node.reforming = True
    node.peer_failed()
    assert not node.broken  # the re-formation under way answers it
    node.reforming, node.reformed_at = False, node.clock.monotonic()
    node.peer_failed()
    assert not node.broken  # within RECENT of the re-formation's end: the same failure
    node.clock.advance(in_process_agent.RECENT)
    node.news.clear()
    relay = in_process_agent._hear_daemon(node)
    try:
        os.kill(os.getpid(), job_rules.PEER_FAILED_SIGNAL)  # what the daemon sends
        _wait(node.news.is_set, 5)
        assert node.broken and node.broken_at is not None
    finally:
        relay.close()
    assert signal.getsignal(job_rules.PEER_FAILED_SIGNAL) in (signal.SIG_DFL, signal.SIG_IGN,
                                                              None)


def test_workers_restarted_into_a_round_learn_where_they_were(monkeypatch):
    """A node that falls back restarts its workers into the new round on the same node, whose
    RAM holds the steps its old workers completed: each fresh worker learns the rank and world
    size its local rank had (PREVIOUS_ENV), so its restore offers them as a survivor's. A
    first start learns nothing (a new node has no slot of its own). Before, no worker learned
    it, and a round with a restarted rank took the committed step."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import Worker
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from elasticd.agent import in_process_agent

    rounds = iter([[Worker(i, global_rank=2 + i, world_size=6) for i in range(2)],
                   [Worker(i, global_rank=i, world_size=4) for i in range(2)]])
    started: list[str | None] = []

    def rendezvous(self, wg):
        wg.workers = next(rounds)

    def start(self, wg):
        started.append(os.environ.get(link.PREVIOUS_ENV))
        return {}

    monkeypatch.setattr(LocalElasticAgent, "_rendezvous", rendezvous)
    monkeypatch.setattr(LocalElasticAgent, "_start_workers", start)
    monkeypatch.setattr(in_process_agent, "_node", [SimpleNamespace(local_world=0)])
    monkeypatch.setenv(link.ROUND_ENV, "0")
    monkeypatch.setenv(link.PREVIOUS_ENV, "left over")  # restored after the test
    agent = object.__new__(in_process_agent.InProcessAgent)
    wg = SimpleNamespace(workers=[Worker(i) for i in range(2)],  # torch's placeholders
                         spec=SimpleNamespace(local_world_size=2, rdzv_handler=None))
    for _ in range(2):  # the first start, then a fallback's restart into the next round
        agent._rendezvous(wg)
        agent._start_workers(wg)
    assert started[0] is None
    assert [link.previous_place({link.PREVIOUS_ENV: started[1], "LOCAL_RANK": str(i)})
            for i in range(2)] == [(2, 6), (3, 6)]


@pytest.mark.parametrize("exits", [False, True])
def test_a_newcomers_staged_workers_get_places_only_through_its_round(monkeypatch, exits):
    """The agent's side of staging (fakes for torch's start and round; the whole path runs in
    tests/chaos/test_in_process_compiled.py): the node's first workers start staged before the
    round and are assigned after it; staged workers the round cannot take (one exited) are
    stopped and fresh ones started into the round. A later start is not staged."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import Worker
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from elasticd.agent import in_process_agent

    log: list = []
    alive = [True, not exits]
    handlers = {i: SimpleNamespace(proc=SimpleNamespace(poll=lambda i=i: None if alive[i]
                                                        else 1)) for i in range(2)}

    def start(self, wg):
        log.append(("start", os.environ.get(link.STAGED_ENV), wg.master_addr, wg.group_rank))
        self._pcontext = SimpleNamespace(pids=lambda: {0: 100, 1: 101},
                                         subprocess_handlers=handlers)
        return {0: 100, 1: 101}

    def rendezvous(self, wg):
        log.append(("round",))
        wg.workers = [Worker(i, global_rank=4 + i, role_rank=4 + i, world_size=6,
                             role_world_size=6) for i in range(2)]
        wg.group_rank, wg.group_world_size = 2, 3
        wg.master_addr, wg.master_port = "127.0.0.1", 29500

    server = SimpleNamespace(linked=lambda: {0} if exits else {0, 1}, wait=lambda t: None,
                             send=lambda local, msg: log.append(("send", local, msg["op"],
                                                                 msg["env"]["RANK"])))
    monkeypatch.setattr(LocalElasticAgent, "_start_workers", start)
    monkeypatch.setattr(LocalElasticAgent, "_rendezvous", rendezvous)
    monkeypatch.setattr(in_process_agent, "_node", [SimpleNamespace(
        local_world=0, link=server, clock=in_process_agent.SystemClock())])
    monkeypatch.setenv(link.ROUND_ENV, "0")
    # The agent sets its workers' old places here at a fresh start: gone after the test.
    monkeypatch.setenv(link.PREVIOUS_ENV, "")
    from torch.distributed.elastic.agent.server import api as torch_agent_api
    monkeypatch.setattr(torch_agent_api, "record", lambda *a, **k: None)  # torch's events
    agent = object.__new__(in_process_agent.InProcessAgent)
    agent._construct_event = lambda *a, **k: None
    agent._stop_workers = lambda wg: log.append(("stop",))
    agent._remaining_restarts, agent._pcontext = 3, None
    wg = SimpleNamespace(workers=[Worker(i) for i in range(2)], store=None, master_addr=None,
                         master_port=None, group_rank=None, group_world_size=None,
                         spec=SimpleNamespace(local_world_size=2, rdzv_handler=None,
                                              max_restarts=3, role="default",
                                              event_log_handler="null"))
    agent._initialize_workers(wg)
    staged = [("start", "1", "", -1), ("round",)]
    if exits:  # never assigned: stopped, and fresh ones started after the round
        assert log == [*staged, ("stop",), ("start", None, "127.0.0.1", 2)]
    else:
        assert log == [*staged, ("send", 0, "assign", "4"), ("send", 1, "assign", "5")]
    assert link.STAGED_ENV not in os.environ and wg.store is None  # placeholders undone
    assert [w.id for w in wg.workers] == [100, 101]
    log.clear()
    agent._initialize_workers(wg)  # torch's restart of this node's workers: after the round
    assert log == [("round",), ("start", None, "127.0.0.1", 2)]

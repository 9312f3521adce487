"""The daemon's HTTP endpoint against callers who hold connections open, on real sockets.

Anyone who reaches the port is untrusted: 300 idle connections must not become 300 threads,
must be closed after the deadline, and must not keep a scrape out; /status over the network
must not show lease ids, pids or log paths.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry

from elasticd.daemon.http import StatusServer

STATUS = {"node": "n1", "lease": "694d7a0c1b2e3f40", "state": "running",
          "job": {"job": "train", "state": "running", "agent_pid": 4242,
                  "log": "/var/lib/elasticd/n1/jobs/train/agent.log", "ranks": [0, 1]}}


def wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


@contextlib.contextmanager
def status_server():
    server = StatusServer(("127.0.0.1", 0), CollectorRegistry(), lambda: STATUS, lambda: True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def get(server: StatusServer, path: str) -> bytes:
    with urllib.request.urlopen(f"http://{server.address}{path}", timeout=10) as resp:
        return resp.read()


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def test_idle_connections_are_capped_closed_and_do_not_keep_a_scrape_out():
    def http_threads() -> int:
        # Counted by name: other tests' threads may come and go in this process meanwhile.
        return sum(t.name.startswith("http-conn-") for t in threading.enumerate())

    with status_server() as server:
        host, port = server.address.rsplit(":", 1)
        # One caller trickles a request line, a byte a second (each read well within the
        # read timeout): only the whole-connection deadline ends it.
        trickler = socket.create_connection((host, int(port)), timeout=5)
        stop = threading.Event()

        def trickle() -> None:
            with contextlib.suppress(OSError):
                for byte in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"a" * 100:
                    trickler.send(bytes([byte]))
                    if stop.wait(1.0):
                        return

        slow = threading.Thread(target=trickle, daemon=True)
        slow.start()
        idle = [socket.create_connection((host, int(port)), timeout=5,
                                         source_address=("127.0.0.2", 0)) for _ in range(300)]
        try:
            # Accepted in order, so once this scrape is answered all 300 were accepted.
            assert get(server, "/healthz") == b"ok\n"
            # The cap: a displaced connection's thread ends a moment after its socket is shut
            # (it may still be on its way out while its replacement starts).
            wait_for(lambda: http_threads() <= 16, timeout=5)
            for sock in idle:
                sock.setblocking(False)
            # Each is closed by the server: displaced at once, or at its deadline.
            wait_for(lambda: all(closed_by_server(s) for s in idle), timeout=15)
            trickler.setblocking(False)
            wait_for(lambda: closed_by_server(trickler), timeout=15)
            wait_for(lambda: http_threads() <= 1)  # the trickler's, until its deadline
        finally:
            stop.set()
            slow.join(5)
            for sock in idle + [trickler]:
                sock.close()


def test_status_over_the_network_has_no_lease_pid_or_log_path():
    with status_server() as server:
        doc = json.loads(get(server, "/status"))
        assert doc["node"] == "n1" and doc["job"]["ranks"] == [0, 1]
        assert "lease" not in doc
        assert "agent_pid" not in doc["job"] and "log" not in doc["job"]
        assert STATUS["job"]["agent_pid"] == 4242  # the daemon's own document is untouched
        get(server, "/metrics")  # still served (raises on an error status)

"""store_connect: a worker of rank > 0 waits for rank 0's TCPStore without torch's back-off.

Real sockets on 127.0.0.1 and a real TCPStore; the wrapper is installed on the module in this
process and removed after each test.
"""

from __future__ import annotations

import datetime
import importlib
import socket
import threading
import time

import pytest
import torch.distributed as dist

from elasticd import listening
from elasticd.agent import store_connect

RDZV = importlib.import_module("torch.distributed.rendezvous")


@pytest.fixture
def restore_rdzv():
    original = RDZV._create_c10d_store
    yield
    RDZV._create_c10d_store = original


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listen_later(port: int, delay: float, box: list) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(8)
        box.append(s)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_wait_listening_returns_once_the_port_opens():
    """The poll both paths to a round's store make before connecting (the warm workers' store
    wrapper, an in-process worker's re-formation), where torch's client would back off for up
    to a second: it returns once the port listens (the next test: gives up at its timeout)."""
    port, box = _free_port(), []
    t = _listen_later(port, 0.1, box)
    try:
        start = time.monotonic()
        assert listening.wait_listening("127.0.0.1", port, 5.0)
        assert 0.09 <= time.monotonic() - start < 2.0
    finally:
        t.join()
        for s in box:
            s.close()


def test_wait_listening_gives_up_after_the_timeout():
    start = time.monotonic()
    assert not listening.wait_listening("127.0.0.1", _free_port(), 0.2)
    assert 0.15 <= time.monotonic() - start < 1.5


def test_only_clients_wait_and_they_keep_the_time_left(restore_rdzv):
    calls = []
    RDZV._create_c10d_store = lambda *a: calls.append(a) or "store"
    store_connect.install()
    store_connect.install()  # idempotent: not wrapped twice
    assert RDZV._create_c10d_store.elasticd_wrapped
    assert not getattr(RDZV._create_c10d_store.__wrapped__, "elasticd_wrapped", False)
    port = _free_port()  # nothing listens
    start = time.monotonic()
    timeout = datetime.timedelta(seconds=0.3)
    assert RDZV._create_c10d_store("127.0.0.1", port, 0, 2, timeout, True) == "store"
    assert time.monotonic() - start < 0.2, "rank 0 hosts the store: it must not wait"
    assert calls[-1] == ("127.0.0.1", port, 0, 2, timeout, True)
    RDZV._create_c10d_store("127.0.0.1", port, 1, 2, timeout, True)
    assert time.monotonic() - start >= 0.25, "rank 1 waits for the port within the timeout"
    assert calls[-1][4] == datetime.timedelta(seconds=1), "then gets what is left, >= 1 s"


def test_a_client_started_before_the_server_connects_without_the_back_off(restore_rdzv):
    """torch's client, finding nothing listening, sleeps 250-750 ms (Backoff.hpp) before trying
    again; through the wrapper it connects as soon as the server listens."""
    store_connect.install()
    port, result = _free_port(), {}

    def client() -> None:
        result["store"] = RDZV._create_c10d_store("127.0.0.1", port, 1, 2,
                                                  datetime.timedelta(seconds=10), True)
        result["at"] = time.monotonic()

    t = threading.Thread(target=client, daemon=True)
    t.start()
    time.sleep(0.1)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False, multi_tenant=True)
    listening = time.monotonic()
    t.join(timeout=15)
    assert "at" in result, "the client never connected"
    result["store"].set("k", "v")
    assert server.get("k") == b"v"
    assert result["at"] - listening < 0.24, "the client waited out torch's connect back-off"

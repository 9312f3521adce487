"""The replica server's table of connections (:mod:`elasticd.replication.connections`), alone:
the pending cap and who it displaces, the authenticated cap, and a stop. The server's own tests
(test_replication_attacks.py, test_replication_transport.py) drive it over real sockets."""

from __future__ import annotations

import threading

from elasticd.replication.connections import Connections
from elasticd.replication.server import ServerStats
from elasticd.testing.clock import FakeClock


def conn():
    return threading.Thread(target=lambda: None), object()


def test_a_full_pending_cap_displaces_the_oldest_and_the_displaced_cannot_authenticate():
    table = Connections(ServerStats(), max_connections=1, max_pending=1, handshake_timeout=10,
                        clock=FakeClock())
    (t1, s1), (t2, s2) = conn(), conn()
    assert table.admit(t1, s1, "10.0.0.1") == (True, None)
    assert table.admit(t2, s2, "10.0.0.1") == (True, s1)
    assert set(table.sockets()) == {t1, t2}
    assert table.authenticate(t1) == ("handshake deadline passed, or displaced by a newer "
                                      "connection")
    assert table.handshake_failed(t1) == (True, False)
    assert table.authenticate(t2) is None


def test_authenticated_peers_are_capped_until_one_ends():
    table = Connections(ServerStats(), max_connections=1, max_pending=4, handshake_timeout=10,
                        clock=FakeClock())
    (t1, s1), (t2, s2), (t3, s3) = conn(), conn(), conn()
    for t, s in ((t1, s1), (t2, s2), (t3, s3)):
        table.admit(t, s, "10.0.0.1")
    assert table.authenticate(t1) is None
    assert table.authenticate(t2) == "1 peers connected"
    table.end(t2, False)
    table.end(t1, True)
    assert table.authenticate(t3) is None
    assert set(table.sockets()) == {t3}


def test_a_stop_turns_newcomers_and_pending_handshakes_away_once():
    table = Connections(ServerStats(), max_connections=4, max_pending=4, handshake_timeout=10,
                        clock=FakeClock())
    (t1, s1), (t2, s2) = conn(), conn()
    table.admit(t1, s1, "10.0.0.1")
    assert table.stop() and not table.stop()
    assert table.admit(t2, s2, "10.0.0.2") == (False, None)
    assert table.authenticate(t1) == "stopping"
    table.bump(bytes_received=5)
    assert table.snapshot().bytes_received == 5

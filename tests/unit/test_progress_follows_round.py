"""``elasticd.worker.progress()`` follows the process into a re-formed round (issue 31).

Under ``@elasticd.in_process`` the same process gets another rank and world size when the
group re-forms (the wrapper updates its environment with the round's). The shared client read
its identity once, so every report after a rank change still named the old rank: counted
under a rank this process no longer is, or refused by the daemon, which binds a connection's
writes to the first rank it wrote for. A real local server and client over a real socket.
"""

from __future__ import annotations

import logging

from elasticd.worker.client import DaemonClient, WorkerIdentity
from tests.unit.test_local_api import (  # noqa: F401 — fixtures
    clients, make_server, rec, servers, sockdir)


def test_progress_names_the_rank_of_the_current_round_on_a_new_connection(
        make_server, rec, clients, caplog):
    server = make_server(handlers={**rec.handlers(), "progress": rec._record})
    env = {"ELASTICD_SOCKET": server.path, "ELASTICD_JOB": "j", "RANK": "4",
           "LOCAL_RANK": "0", "WORLD_SIZE": "6", "GROUP_RANK": "2",
           "TORCHELASTIC_RESTART_COUNT": "0"}
    client = DaemonClient.from_env(env, timeout=5.0)
    clients.append(client)
    assert client.progress(10)
    client.call("echo")  # the same connection, served in order: the report is in
    first = client._sock
    env.update(RANK="2", WORLD_SIZE="4", GROUP_RANK="1")  # the re-formed round's assignment
    assert client.progress(11) and client.progress(12)
    client.call("echo")
    got = [(r["rank"], r["world_size"], r["step"]) for r in rec.records]
    assert got == [(4, 6, 10), (2, 4, 11), (2, 4, 12)]
    assert client._sock is not first  # the old rank's connection closed, a new one opened
    assert client.identity == WorkerIdentity(job="j", rank=2, local_rank=0, world_size=4,
                                             group_rank=1, restart_count=0)
    with caplog.at_level(logging.WARNING):
        env["RANK"] = "two"  # malformed: the identity stays, the report still goes
        assert client.progress(13)
        client.call("echo")
    assert rec.records[-1]["rank"] == 2
    assert any("keeping this worker's identity (rank 2)" in r.getMessage()
               for r in caplog.records)


def test_a_client_given_its_identity_keeps_it():
    client = DaemonClient("/nonexistent.sock", WorkerIdentity(job="j", rank=1))
    assert client._current_identity() == WorkerIdentity(job="j", rank=1)

"""A job's process names one rank, within its spec's largest world, however many connections it
opens (issue 26, finding 5: each new connection could claim a new rank, and a rank could be any
integer, so one process grew the daemon's per-rank state without bound).

Real sockets, a real server and real client processes running as a user the test creates;
against a real daemon with a real job: ``tests/integration/test_hostile_worker.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elasticd.local.job_scope import JobScope, start_time
from elasticd.daemon.local_binding import RankClaims, outside_world
from tests.unit.test_local_binding import daemon, users  # noqa: F401 (fixtures)

# Runs [connection, op, fields] requests, each on the connection of that index (opened at its
# first use; op "close" closes it), and prints what each returned. A request with "_retry"
# is tried again for up to 5 s while refused (the server lets go of a closed connection's
# claim when its thread sees the end of the stream, a moment after the close).
CLIENT = r"""
import json, sys, time
from elasticd.worker.client import DaemonClient, DaemonClientError
sys.stdin.readline()
conns = {}
for n, op, fields in json.loads(sys.argv[1]):
    if op == "close":
        conns.pop(n).close()
        print(json.dumps({"closed": n}), flush=True)
        continue
    c = conns.setdefault(n, DaemonClient(sys.argv[2], timeout=5))
    deadline = time.monotonic() + (5 if fields.pop("_retry", False) else 0)
    while True:
        try:
            print(json.dumps({"ok": c.call(op, **fields)}), flush=True)
            break
        except DaemonClientError as exc:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            print(json.dumps({"error": str(exc)}), flush=True)
            break
"""


def test_ranks_and_world_sizes_beyond_the_largest_world_are_named_as_such():
    assert outside_world({"rank": 7, "world_size": 8}, 8) == ""
    assert "rank 8 is outside the job's largest world (8 ranks" in outside_world({"rank": 8}, 8)
    assert "rank -1 is outside" in outside_world({"rank": -1}, 8)
    assert "world size 9 is larger" in outside_world({"rank": 0, "world_size": 9}, 8)
    assert outside_world({"rank": "x", "world_size": None}, 8) == ""  # the handler refuses those


def test_one_rank_per_pid_while_any_of_its_connections_holds_it():
    claims = RankClaims()
    assert claims.claim("j", 10, 0) == "" and claims.claim("j", 10, 0) == ""
    assert "writes for rank 0 of j" in claims.claim("j", 10, 1)
    assert claims.claim("j", 11, 1) == "" and claims.claim("k", 10, 1) == ""
    claims.release("j", 10)
    assert "one rank per process" in claims.claim("j", 10, 1)  # one connection still holds 0
    claims.release("j", 10)
    held = {key: rank for key, (rank, _) in claims._claims.items()}
    assert held == {("j", 11): 1, ("k", 10): 1}
    assert claims.claim("j", 10, 1) == ""  # its last connection closed: a reused pid is new


def run_client(srv, scope, user, requests, world_max=4):
    """Runs ``requests`` as a process of job ``a`` (its largest world: ``world_max``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["ELASTICD_TAG"] = "/p:n1:a"
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, json.dumps(requests), srv.path],
                            user=user.pw_uid, group=user.pw_gid, extra_groups=[], env=env,
                            cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    scope["now"] = JobScope(job="a", uid=user.pw_uid, roots={proc.pid: start_time(proc.pid)},
                            world_max=world_max)
    out, err = proc.communicate("go\n", timeout=30)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def progress(rank: int, world: int = 4) -> dict:
    return {"job": "a", "rank": rank, "world_size": world, "step": 1}


ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="creates users: needs root (CI is)")


@ROOT
def test_new_connections_of_one_process_cannot_claim_new_ranks(daemon, users):
    srv, scope, handlers = daemon
    replies = run_client(srv, scope, users[0], [
        [0, "progress", progress(0)],
        [1, "progress", progress(1)],     # the same pid on another connection: refused
        [2, "ckpt_reserve", {**progress(2), "nbytes": 8}],
        [1, "progress", progress(0)],     # its own rank on that connection: fine
        [0, "close", {}], [1, "close", {}],
        [3, "progress", {**progress(2), "_retry": True}],  # no connection holds its claim
    ])
    errors = [r.get("error", "") for r in replies]
    assert "ok" in replies[0] and "ok" in replies[3] and "ok" in replies[6], replies
    assert "writes for rank 0 of a (on another connection), not rank 1" in errors[1]
    assert "not rank 2: one rank per process" in errors[2]
    assert handlers.ops() == [("progress", "a", 0), ("progress", "a", 0), ("progress", "a", 2)]


@ROOT
def test_no_rank_or_world_beyond_the_specs_largest_world(daemon, users):
    srv, scope, handlers = daemon
    replies = run_client(srv, scope, users[0], [
        [0, "progress", progress(0, 8)],
        [1, "ckpt_reserve", {**progress(10**9, 10**9 + 1), "nbytes": 8}],
        [2, "ckpt_fetch", {"job": "a", "rank": 4, "generation": 0, "step": 1}],
        [3, "ckpt_list", {"job": "a", "rank": 99}],
        [4, "progress", progress(3)],
        [4, "ckpt_fetch", {"job": "a", "rank": 1, "generation": 0, "step": 1}],
    ])
    errors = [r.get("error", "") for r in replies]
    assert all("outside the job's largest world (4 ranks" in e for e in errors[1:4]), errors
    assert "world size 8 is larger than the job's largest world (4" in errors[0]
    assert "ok" in replies[4] and "ok" in replies[5]
    assert handlers.ops() == [("progress", "a", 3), ("ckpt_fetch", "a", 1)]

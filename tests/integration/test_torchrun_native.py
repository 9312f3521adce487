"""Plain torchrun on elasticd's own rendezvous handler (``--rdzv-backend etcd-v3``), no daemon,
with a spare beyond ``--nnodes`` max: kill -9 of a member's whole process group lets the spare
take its place; an etcd paused past the lease TTL drops nobody and restarts nothing.

Each torchrun runs in a session of its own and its whole process group is killed in a
``finally``, so a hung agent cannot leave workers behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.rendezvous import BACKEND_NAME
from tests.integration.test_torchrun_plain import _kill_group

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "allreduce.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _start(server, prefix: str, run_id: str, nnodes: str, node: int, tmp_path,
           *worker_args: str) -> tuple[subprocess.Popen, object]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = tmp_path / f"node{node}.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(TORCHRUN + [
            "--nnodes", nnodes, "--nproc-per-node", "1",
            "--rdzv-backend", BACKEND_NAME, "--rdzv-endpoint", server.endpoints,
            "--rdzv-id", run_id,
            "--rdzv-conf", f"key_prefix={prefix},join_timeout=60,last_call_timeout=1,"
                           "liveness_ttl=2",
            "--local-addr", "127.0.0.1", "--max-restarts", "3", "--monitor-interval", "0.1",
            "--log-dir", str(tmp_path / f"logs{node}"),
            WORKER, *worker_args,
        ], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env)
    return proc, out


def _round(client: EtcdCoordinator, prefix: str, run_id: str) -> dict | None:
    kv = client.get(Keyspace(prefix).rendezvous(run_id).round)
    return None if kv is None else json.loads(kv.value)


def _first_round(client: EtcdCoordinator, prefix: str, run_id: str,
                 timeout: float = 60.0) -> dict:
    """The first round's record, once some agent wrote it."""
    deadline = time.monotonic() + timeout
    while (rnd := _round(client, prefix, run_id)) is None:
        assert time.monotonic() < deadline, f"no round formed within {timeout}s"
        time.sleep(0.1)
    return rnd


def _assert_trained_at_world_2(codes: list[int], nodes: list[tuple]) -> None:
    """Both nodes exited 0 and their workers all-reduced as ranks 0 and 1 of 2, each
    hosting its own TCPStore (no agent store shared)."""
    texts = [o.read_text() for _, o in nodes]
    assert codes == [0, 0], "\n\n".join(texts)
    lines = sorted(ln for t in texts for ln in t.splitlines() if ln.startswith("ALLREDUCE"))
    assert lines == ["ALLREDUCE rank=0 world=2 sum=3 share_store=False",
                     "ALLREDUCE rank=1 world=2 sum=3 share_store=False"], "\n\n".join(texts)


def _connect(server) -> EtcdCoordinator:
    return EtcdCoordinator(EtcdSettings(parse_endpoints(server.endpoints), timeout=1.0))


@pytest.mark.etcd
@pytest.mark.timeout(150)
def test_a_spare_replaces_a_killed_node_and_training_resumes(etcd, prefix, tmp_path):
    run_id = f"spare-{uuid.uuid4().hex[:8]}"
    client = _connect(etcd)
    started = [_start(etcd, prefix, run_id, "2:2", n, tmp_path, "2", "6") for n in range(3)]
    by_pid = {p.pid: (p, o) for p, o in started}
    try:
        rnd = _first_round(client, prefix, run_id)
        pids = [int(m.split("_")[1]) for m in rnd["members"]]
        [spare_pid] = set(by_pid) - set(pids)
        time.sleep(1.0)  # let the first round's workers start training
        victim, _ = by_pid[pids[0]]
        killed_at = time.monotonic()
        _kill_group(victim)
        survivors = [by_pid[pids[1]], by_pid[spare_pid]]
        codes = [p.wait(timeout=100) for p, _ in survivors]
        took = time.monotonic() - killed_at
    finally:
        client.close()
        for p, _ in started:
            _kill_group(p)
    _assert_trained_at_world_2(codes, survivors)
    print(f"kill -> survivors done (6 s of training after the re-rendezvous): {took:.1f}s")


@pytest.mark.etcd
@pytest.mark.timeout(150)
def test_an_etcd_pause_past_the_ttl_with_a_spare_drops_nobody_and_restarts_nothing(
        private_etcd, prefix, tmp_path):
    # When etcd resumes after 2 x TTL it expires every lease at once; each agent re-grants and
    # re-writes its record. A member absent meanwhile must not count as gone, or the waiting
    # spare would look admissible and every member would restart into a new round.
    run_id = f"pause-{uuid.uuid4().hex[:8]}"
    member = private_etcd.members[0]
    client = _connect(private_etcd)
    started = [_start(private_etcd, prefix, run_id, "2:2", n, tmp_path, "2", "14")
               for n in range(3)]
    by_pid = {p.pid: (p, o) for p, o in started}
    try:
        rnd = _first_round(client, prefix, run_id)
        members = [by_pid[int(m.split("_")[1])] for m in rnd["members"]]
        time.sleep(1.0)
        member.signal(signal.SIGSTOP)
        try:
            time.sleep(2 * 2 + 1)  # 2 x liveness_ttl, and then some
        finally:
            member.signal(signal.SIGCONT)
        codes = [p.wait(timeout=100) for p, _ in members]
        final = _round(client, prefix, run_id)
    finally:
        member.signal(signal.SIGCONT)
        client.close()
        for p, _ in started:
            _kill_group(p)
    texts = [o.read_text() for _, o in members]
    assert codes == [0, 0], "\n\n".join(texts)
    assert final["round"] == 0, f"a new round formed: {final}"
    assert not any("will restart worker group" in t for t in texts), "\n\n".join(texts)
    assert sum("sum=3" in t for t in texts) == 2, "\n\n".join(texts)

"""Plain torchrun on the etcd-v3 rendezvous, with no elasticd daemon involved.

Two torchrun processes stand for two nodes; they meet through the ``etcd`` fixture's server
and run one gloo all_reduce. Each torchrun runs in a session of its own and its whole process
group is killed in a ``finally``, so a hung agent cannot leave workers behind.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
import uuid

import pytest

from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.rendezvous_backend import decode_state

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "allreduce.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PLUGIN_WARNING = "Exception while registering out of tree plugin"


def connect(server, timeout: float = 1.0) -> EtcdCoordinator:
    # Not imported from conftest: whether tests/ is a package decides how that would import.
    return EtcdCoordinator(EtcdSettings(parse_endpoints(server.endpoints), timeout=timeout))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Loopback only, one thread per worker (2 shared cores).
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the handler creator must set it
    return env


def _start(args: list[str], out_path) -> subprocess.Popen:
    with open(out_path, "w") as out:
        return subprocess.Popen(TORCHRUN + args, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=_env())


def _kill_group(proc: subprocess.Popen) -> None:
    # The group outlives its leader if workers were orphaned: signal it either way.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.mark.etcd
@pytest.mark.timeout(120)
def test_two_torchrun_nodes_meet_through_etcd_v3(etcd, etcd_client, prefix, tmp_path):
    run_id = f"plain-{uuid.uuid4().hex[:8]}"
    procs, outs = [], []
    try:
        for node in range(2):
            out = tmp_path / f"node{node}.out"
            procs.append(_start([
                "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoints,
                "--rdzv-id", run_id,
                "--rdzv-conf", f"key_prefix={prefix},join_timeout=60,last_call_timeout=1",
                "--local-addr", "127.0.0.1", "--max-restarts", "0",
                "--log-dir", str(tmp_path / f"logs{node}"),
                WORKER, "2",
            ], out))
            outs.append(out)
        codes = [p.wait(timeout=100) for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
    texts = [o.read_text() for o in outs]
    assert codes == [0, 0], "\n\n".join(texts)
    lines = [ln for t in texts for ln in t.splitlines() if ln.startswith("ALLREDUCE")]
    assert sorted(lines) == [
        "ALLREDUCE rank=0 world=2 sum=3 share_store=False",
        "ALLREDUCE rank=1 world=2 sum=3 share_store=False",
    ], "\n\n".join(texts)
    assert not any(PLUGIN_WARNING in t for t in texts)

    # The rendezvous lived in etcd under the job's rdzv/ prefix; torchrun closed it on exit.
    rdzv = Keyspace(prefix).job_rdzv(run_id)
    state = pickle.loads(decode_state(etcd_client.get(rdzv + b"state").value))
    assert state.closed and state.complete and len(state.participants) == 2
    store_keys = [kv.key for kv in etcd_client.get_prefix(rdzv + b"store/")[0]]
    assert rdzv + b"store/torch.rendezvous." + run_id.encode() + b".0/MASTER_ADDR" in store_keys
    # Each agent revoked its liveness lease on shutdown: no alive key waits out its TTL.
    assert etcd_client.get_prefix(rdzv + b"alive/")[0] == []


@pytest.mark.etcd
@pytest.mark.timeout(120)
def test_training_survives_an_etcd_pause_inside_the_grace_period(private_etcd, prefix,
                                                                 tmp_path):
    # The agents poll num_nodes_waiting() and send heartbeats while the workers train; both
    # go through the backend, which must ride out the pause instead of ending the job.
    run_id = f"pause-{uuid.uuid4().hex[:8]}"
    member = private_etcd.members[0]
    procs, outs = [], []
    try:
        for node in range(2):
            out = tmp_path / f"node{node}.out"
            procs.append(_start([
                "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", private_etcd.endpoints,
                "--rdzv-id", run_id,
                "--rdzv-conf", f"key_prefix={prefix},join_timeout=60,last_call_timeout=1,"
                               "etcd_grace_period=10,etcd_timeout=1",
                "--local-addr", "127.0.0.1", "--max-restarts", "0",
                "--log-dir", str(tmp_path / f"logs{node}"),
                WORKER, "2", "12",
            ], out))
            outs.append(out)
        # Pause etcd once both workers train (each prints nothing until the end: wait for the
        # rendezvous to be complete instead).
        _wait_for_round(private_etcd, prefix, run_id, timeout=60)
        time.sleep(1)
        member.signal(signal.SIGSTOP)
        try:
            time.sleep(5)
        finally:
            member.signal(signal.SIGCONT)
        codes = [p.wait(timeout=90) for p in procs]
    finally:
        member.signal(signal.SIGCONT)
        for p in procs:
            _kill_group(p)
    texts = [o.read_text() for o in outs]
    assert codes == [0, 0], "\n\n".join(texts)
    assert sum("sum=3" in t for t in texts) == 2, "\n\n".join(texts)
    assert any("unreachable while" in t for t in texts), "the pause was not noticed"


def _wait_for_round(server, prefix, run_id, timeout):
    coordinator = connect(server)
    key = Keyspace(prefix).job_rdzv(run_id) + b"state"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            kv = coordinator.get(key)
            if kv is not None and pickle.loads(decode_state(kv.value)).complete:
                return
            time.sleep(0.2)
    finally:
        coordinator.close()
    raise AssertionError(f"the rendezvous did not complete within {timeout}s")


@pytest.mark.timeout(120)
def test_other_rendezvous_backends_still_work_with_the_plugin_installed(tmp_path):
    out = tmp_path / "standalone.out"
    proc = _start(["--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
                   "--log-dir", str(tmp_path / "logs"), WORKER, "1"], out)
    try:
        code = proc.wait(timeout=100)
    finally:
        _kill_group(proc)
    text = out.read_text()
    assert code == 0, text
    assert "ALLREDUCE rank=0 world=1 sum=1" in text
    assert PLUGIN_WARNING not in text

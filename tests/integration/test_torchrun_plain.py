"""Plain torchrun on the etcd-v3 rendezvous (elasticd's own handler), with no daemon involved.

Two torchrun processes stand for two nodes; they meet through the ``etcd`` fixture's server
and run one gloo all_reduce; the rendezvous leaves JSON records only. Spares, kill -9 and an
etcd pause with plain torchrun are in ``test_torchrun_native.py``. Each torchrun runs in a session of its own and its whole process
group is killed in a ``finally``, so a hung agent cannot leave workers behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from elasticd.coordination.keys import Keyspace

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "allreduce.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PLUGIN_WARNING = "Exception while registering out of tree plugin"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Loopback only, one thread per worker (2 shared cores).
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # The handler alone must keep workers off the agent's store (use_agent_store False).
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
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

    # The rendezvous lived in etcd under the job's rdzv/ prefix as JSON records (no pickle);
    # torchrun closed it on exit, and each agent revoked its lease, deleting its join record.
    native = Keyspace(prefix).rendezvous(run_id).prefix + b"native/"
    kvs = {kv.key[len(native):]: json.loads(kv.value)
           for kv in etcd_client.get_prefix(native)[0]}
    # The closer's key went with its lease; its waiting summary may stay.
    assert {b"round", b"round.closed"} <= set(kvs) <= {b"round", b"round.closed",
                                                      b"round.waiting"}, kvs
    assert all(v["v"] == 2 for v in kvs.values())
    assert (kvs[b"round"]["round"], len(kvs[b"round"]["members"])) == (0, 2)
    # The workers' store address came in the round record, from the port rank 0 held free.
    assert kvs[b"round"]["master_addr"] == "127.0.0.1" and kvs[b"round"]["master_port"] > 0
    rdzv = Keyspace(prefix).rendezvous(run_id).prefix
    assert etcd_client.get(rdzv + b"state") is None  # torch's pickled state is gone for good
    store_keys = [kv.key for kv in etcd_client.get_prefix(rdzv + b"store/")[0]]
    assert any(k.startswith(rdzv + b"store/torch.rendezvous." + run_id.encode() + b".0/")
               for k in store_keys), store_keys


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

"""Real torchrun jobs checkpointing every step through a daemon-side service on a real socket.

The test process plays the node daemon: a SlotStore on tmpfs, a Persister (every 5 steps) and
the CheckpointService, served by a LocalServer that the workers reach through
``ELASTICD_SOCKET``. A 2-worker gloo job (``torchrun --standalone``) trains 20 steps; on its first
attempt rank 1 kills itself with SIGKILL after step 7, torchrun restarts both workers, they
restore and finish. Their final weights and optimizer state must be bitwise equal to those of a
run without the failure (and without elasticd). Three faults:

* none: restore from the daemon's RAM at step 7, no step lost;
* the job's segments deleted before the restart: restore from the persistent tier at step 5,
  2 steps lost, reported as such;
* payload bytes flipped in rank 1's slot files: refused (checksum), persistent tier used.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest
import safetensors.torch
import torch

from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.daemon.local_api import LocalServer
from elasticd.persistence.persister import Persister

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "ckpt_train.py")
TOTAL, KILL_AT = 20, 7

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Node:
    """The daemon's checkpoint half, in this process, plus a fault hook for the workers."""

    def __init__(self, tmp_path):
        self.shm = f"/dev/shm/elasticd-it-{uuid.uuid4().hex[:10]}"
        self.sockdir = tempfile.mkdtemp(prefix="ed-")
        self.store = SlotStore(self.shm)
        self.persister = Persister(str(tmp_path / "persist"), keep=3, every_steps=5)
        self.service = CheckpointService(self.store, "n1", self.persister)
        handlers = {**self.service.handlers(), "test_fault": self.fault}
        self.server = LocalServer(os.path.join(self.sockdir, "elasticd.sock"), handlers)
        self.server.start()

    def fault(self, msg):
        job = msg["job"]
        self.persister.flush(30)  # step 5 is on disk before the RAM goes
        if msg["kind"] == "drop":
            self.store.remove_job(job)  # the segments go; the service still knows the progress
        elif msg["kind"] == "corrupt":
            for version in self.store.versions(job, 1):
                view = self.store.latest(job, 1, version=version)
                with open(view.path, "r+b") as f:
                    f.seek(view.header.layout.entries[0].offset + 3)
                    byte = f.read(1)[0]
                    f.seek(-1, 1)
                    f.write(bytes([byte ^ 0x40]))
        return {}

    def close(self):
        self.server.stop()
        self.persister.close()
        self.store.close()
        shutil.rmtree(self.sockdir, ignore_errors=True)
        assert not os.path.exists(self.shm), "the slot store must leave nothing in /dev/shm"


def torchrun(out_dir, log_path, *, node=None, job="job", kill_at=0, fault="none"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if node is not None:
        env.update(ELASTICD_SOCKET=node.server.path, ELASTICD_JOB=job)
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "--max-restarts", "1",
           "--log-dir", os.path.join(out_dir, "torchrun-logs"),
           WORKER, out_dir, str(TOTAL), str(kill_at), fault]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        code = proc.wait(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # workers orphaned by a failure go too
        except ProcessLookupError:
            pass
        proc.wait()
    text = open(log_path).read()
    assert code == 0, text[-6000:]
    return text


def finals(out_dir):
    return [safetensors.torch.load_file(os.path.join(out_dir, f"final-rank{r}.safetensors"))
            for r in range(2)]


def restored(text):
    """{rank: (step, source, lost, refused)} of the restarted attempt."""
    out = {}
    for m in re.finditer(r"RESTORED rank=(\d) attempt=1 step=(\d+) source=(\w+) lost=(\d+) "
                         r"refused=(\d+)", text):
        out[int(m[1])] = (int(m[2]), m[3], int(m[4]), int(m[5]))
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The same job without any failure and without elasticd."""
    out = str(tmp_path_factory.mktemp("baseline"))
    text = torchrun(out, os.path.join(out, "log.txt"))
    assert "ELASTICD_SOCKET is not set" in text
    return finals(out)


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.close()


def assert_bitwise_equal(got, want):
    for rank, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w)
        assert any(k.startswith("optim/state/") for k in w)  # optimizer state is compared too
        for k in w:
            assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), (rank, k)


def test_kill9_restores_from_ram_with_no_step_lost(node, baseline, tmp_path):
    reports = []
    node.service.on_restore.append(reports.append)
    text = torchrun(str(tmp_path / "run"), str(tmp_path / "log.txt"), node=node, job="ram",
                    kill_at=KILL_AT)
    assert "KILLING rank=1 step=7" in text
    assert restored(text) == {0: (7, "local", 0, 0), 1: (7, "local", 0, 0)}, text[-4000:]
    assert_bitwise_equal(finals(str(tmp_path / "run")), baseline)
    reports = [h for h in reports if h["source"] != "none"]
    assert sorted((h["rank"], h["source"], h["step"], h["steps_lost"]) for h in reports) == \
        [(0, "local", 7, 0), (1, "local", 7, 0)]
    status = node.service.status()["ram"]
    assert status["ranks"] == {"0": [1, 20], "1": [1, 20]}  # a new generation after restore
    assert not status["unprotected"]


def test_ram_emptied_restores_from_persistent_tier_with_steps_lost(node, baseline, tmp_path):
    text = torchrun(str(tmp_path / "run"), str(tmp_path / "log.txt"), node=node, job="drop",
                    kill_at=KILL_AT, fault="drop")
    # Persisted every 5 steps; the job had reached step 7: 2 steps lost, exactly.
    assert restored(text) == {0: (5, "persistent", 2, 0), 1: (5, "persistent", 2, 0)}, \
        text[-4000:]
    assert_bitwise_equal(finals(str(tmp_path / "run")), baseline)
    assert node.service.counters["restores_persistent"] == 2


def test_corrupt_snapshot_is_refused_and_persistent_tier_used(node, baseline, tmp_path):
    text = torchrun(str(tmp_path / "run"), str(tmp_path / "log.txt"), node=node, job="bad",
                    kill_at=KILL_AT, fault="corrupt")
    # Rank 1's RAM copies of steps 7 and 6 both fail their checksums: the newest step every
    # rank can load is the persisted step 5.
    assert restored(text) == {0: (5, "persistent", 2, 0), 1: (5, "persistent", 2, 2)}, \
        text[-4000:]
    assert "REFUSED corrupt snapshot of bad rank 1" not in text  # logged by the daemon (here)
    assert text.count("REFUSED the in-RAM snapshot of rank 1") == 2
    assert node.service.counters["refused"] == 2
    assert_bitwise_equal(finals(str(tmp_path / "run")), baseline)

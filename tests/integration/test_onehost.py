"""The README's "Your own script on one machine": its commands, extracted from README.md and run
as written in one shell (so ``eval "$(... env)"`` carries over), with examples/train_fsdp.py as
the script: a kill -9 of a node and its return, the killed node's rank restored from a peer's
RAM both times (the survivors reshard its shards from peers' copies; the returning node, whose
RAM started empty, fetches its new rank's). Between the lines the test waits for what a user
would wait for. And the one-host multi-GPU recipe's ``up`` line, on CPU: each daemon's workers
see their own GPU set."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest

from elasticd.cluster.events import EventLog
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.replication.commit import read_committed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.etcd]


def readme_blocks(heading: str) -> list[list[str]]:
    """The ```sh blocks of the README section under ``heading``, as lines."""
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split(f"\n{heading}\n", 1)[1]
    section = section.split("\n## " if heading.startswith("## ") else "\n#", 1)[0]
    return [[ln for ln in b.splitlines() if ln.strip()]
            for b in re.findall(r"```sh\n(.*?)```", section, re.S)]


class Shell:
    """One bash, fed a line at a time, as a user types them."""

    def __init__(self, cwd: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(["bash", "--norc", "--noprofile"], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def run(self, command: str, timeout: float = 180.0) -> str:
        marker = f"__done_{uuid.uuid4().hex}"
        self.proc.stdin.write(f"{command}\necho {marker} $?\n")
        self.proc.stdin.flush()
        out, deadline = [], time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.startswith(marker):
                rc = int(line.split()[1])
                text = "".join(out)
                print(f"$ {command}\n{text}", flush=True)
                assert rc == 0, f"{command!r} exited {rc}:\n{text}"
                return text
            out.append(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class View:
    """What the test reads of the cluster (the state file ``up`` writes, etcd, /status)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory

    def state(self) -> dict:
        with open(os.path.join(self.dir, "onehost.json")) as fh:
            return json.load(fh)

    def coord(self) -> EtcdCoordinator:
        return EtcdCoordinator(EtcdSettings(parse_endpoints(self.state()["etcd"]), timeout=2.0))

    def events(self, since: float) -> list:
        coord = self.coord()
        try:
            return [e for e in EventLog(coord, Keyspace("/elasticd")).list() if e.at >= since]
        finally:
            coord.close()

    def committed(self, job: str):
        coord = self.coord()
        try:
            return read_committed(coord, Keyspace("/elasticd"), job)
        finally:
            coord.close()

    def status(self, node: str) -> dict:
        address = self.state()["nodes"][node]["address"]
        with urllib.request.urlopen(f"http://{address}/status", timeout=5) as resp:
            return json.loads(resp.read())


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            value = cond()
            if value:
                return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def restores(view: View, since: float, nodes: set[str]) -> list | None:
    found = [e for e in view.events(since) if e.kind == "recovered"
             and e.data.get("job") == "fsdp" and e.node in nodes]
    return found if {e.node for e in found} == nodes else None


def training_at(view: View, nodes: list[str], world: int, past: int) -> bool:
    sts = [view.status(n)["job"] for n in nodes]
    return all(s["world_size"] == world and s["last_step"] > past for s in sts)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie whose parent is gone does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("elasticd-onehost")}


@pytest.mark.timeout(420)
def test_the_readmes_own_script_commands_kill_and_rejoin_restoring_from_peers(tmp_path):
    block = readme_blocks("## Your own script on one machine")[0]
    verbs = [ln.split()[3] for ln in block if ln.startswith(".venv/bin/python -m elasticd.onehost")]
    assert verbs == ["up", "kill", "start", "down"], block
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    view = View(os.path.join(str(tmp_path), f"elasticd-onehost-{os.getuid()}"))
    shm_before = _shm()
    shell = Shell(REPO, env)
    holder = None
    try:
        for line in block:
            marks = time.time()
            out = shell.run(line)
            if " up " in line:
                holder = view.state()["pid"]
                assert "nodes n1 n2 n3" in out and "replication on" in out, out
            elif line.startswith("elasticctl submit"):
                # A user waits until it trains and a step is committed (m copies of each rank).
                wait_for(lambda: view.committed("fsdp").version[1] >= 20, 180,
                         "step 20 committed")
            elif " kill n2" in line:
                assert "killed n2" in out, out
                got = wait_for(lambda: restores(view, marks, {"n1", "n3"}), 120,
                               "the survivors' restores")
                step = max(e.data["step"] for e in got)
                wait_for(lambda: training_at(view, ["n1", "n3"], 2, step), 120,
                         "training at world size 2")
                # n2's shards exist only as the copies it had pushed to its peers.
                assert any(e.data["source"] == "peer" for e in got), [e.data for e in got]
                # The timeline is written a cycle after the first step past the restore (a
                # quarter second on an idle host): a user reads history once it is there.
                wait_for(lambda: [e for e in view.events(0) if e.kind == "timeline"], 60,
                         "the recovery's timeline")
            elif " start n2" in line:
                assert "started n2" in out, out
                got = wait_for(lambda: restores(view, marks, {"n1", "n2", "n3"}), 180,
                               "the restores at world size 3")
                mine = [e.data for e in got if e.node == "n2"]
                assert mine and all(d["source"] == "peer" for d in mine), mine  # RAM empty
                step = max(e.data["step"] for e in got)
                wait_for(lambda: training_at(view, ["n1", "n2", "n3"], 3, step), 120,
                         "training at world size 3")
            elif line.startswith("elasticctl history --kind failed"):
                assert re.search(r"n2 +failed +[\d.]+", out), out
                assert "timeline" in out and "from a peer's RAM" in out, out
            elif line.startswith("elasticctl history --kind recovered"):
                assert re.search(r"n2 +recovered +- +peer ", out), out
        assert not os.path.exists(os.path.join(view.dir, "onehost.sock"))
        wait_for(lambda: not alive(holder), 30, "the holder's exit")
        assert _shm() <= shm_before, f"left in /dev/shm: {_shm() - shm_before}"
    finally:
        shell.close()
        if holder and alive(holder):  # down did not happen: stop it all
            subprocess.run([sys.executable, "-m", "elasticd.onehost", "down", "--dir",
                            view.dir], timeout=120, env=env)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(holder, signal.SIGKILL)


PROBE = """\
import os, sys, time
print("probe", os.environ["ELASTICD_NODE"], os.environ["LOCAL_RANK"],
      os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), flush=True)
sys.exit(0)
"""


@pytest.mark.timeout(240)
def test_the_gpu_recipes_up_gives_each_daemon_its_gpu_set_tested_on_cpu(tmp_path):
    [[up], [submit]] = readme_blocks("### Several GPUs per node on one host")
    assert "--gpus 0,1:2,3" in up and "--nproc-per-node 2" in submit
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    view = View(os.path.join(str(tmp_path), f"elasticd-onehost-{os.getuid()}"))
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    os.chmod(tmp_path, 0o755)
    shell = Shell(REPO, env)
    holder = None
    try:
        shell.run(up)
        holder = view.state()["pid"]
        shell.run(f'eval "$({sys.executable} -m elasticd.onehost env)"')
        user = "--user nobody" if os.geteuid() == 0 else ""
        shell.run(f"elasticctl submit probe --nnodes 2 --nproc-per-node 2 {user} -- {probe}")
        logs = {n: os.path.join(view.dir, n, "jobs", "probe", "agent.log") for n in ("n1", "n2")}

        def seen():
            out = {}
            for node, path in logs.items():
                text = open(path).read() if os.path.exists(path) else ""
                for m in re.finditer(r"^probe (n\d) (\d) (\S+)$", text, re.M):
                    out[(m.group(1), m.group(2))] = m.group(3)
            return out if len(out) == 4 else None

        got = wait_for(seen, 180, "both nodes' workers' probes")
        assert got == {("n1", "0"): "0,1", ("n1", "1"): "0,1",
                       ("n2", "0"): "2,3", ("n2", "1"): "2,3"}, got
        shell.run(f"{sys.executable} -m elasticd.onehost down")
    finally:
        shell.close()
        if holder and alive(holder):
            subprocess.run([sys.executable, "-m", "elasticd.onehost", "down", "--dir",
                            view.dir], timeout=120, env=env)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(holder, signal.SIGKILL)

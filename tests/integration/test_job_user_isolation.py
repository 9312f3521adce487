"""A job's user against the root daemon's agent supervisor, and a hostile local user against the
job's zygote (issue 13, findings 1, 4 and 13).

Real torchrun agents, workers and zygotes run as a user the test creates; the hostile user is
another one (CI runs as root: nothing here skips).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from elasticd.agent.supervisor import AgentSupervisor
from elasticd.agent.zygote import ZYGOTE_ENV
from elasticd.cluster.jobspec import JobSpec, sha256_file
from elasticd.launcher import reachable
from tests.users import temporary_user

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(180),
              pytest.mark.skipif(os.geteuid() != 0, reason="creates users: needs root (CI is)")]

RDZV = {"close_on_failure": "false", "last_call_timeout": "1", "join_timeout": "60",
        "liveness_ttl": "2"}


@pytest.fixture(scope="module")
def job_user():
    with temporary_user("edj") as user:
        yield user


@pytest.fixture
def place(tmp_path, job_user):
    """Directories as a deployment has them: the daemon's state (root's), the job's scripts
    (readable), a directory the job's user writes (``marks``)."""
    reachable(str(tmp_path))
    marks = tmp_path / "marks"
    marks.mkdir()
    os.chown(marks, job_user.pw_uid, job_user.pw_gid)
    (tmp_path / "scripts").mkdir(mode=0o755)
    (tmp_path / "state" / "jobs").mkdir(parents=True, mode=0o755)
    return tmp_path


def supervisor(place, user, name: str, script: str, args: list[str], etcd, prefix: str,
               cwd: str, warm: bool = False) -> AgentSupervisor:
    spec = JobSpec(name=name, nnodes_min=1, nnodes_max=1, nproc_per_node=1, script=script,
                   args=args, script_sha256=sha256_file(script), user=user.pw_name, cwd=cwd,
                   max_restarts=0)
    return AgentSupervisor(spec, "n1", tag=f"{prefix}:n1:{name}", etcd=etcd.endpoints,
                           prefix=prefix, log_dir=str(place / "state" / "jobs" / name),
                           rdzv_conf=RDZV, warm=warm)


def wait_exit(sup: AgentSupervisor, timeout: float = 90) -> int:
    deadline = time.monotonic() + timeout
    while sup.poll() is None:
        assert time.monotonic() < deadline, open(sup.log_path, errors="replace").read()
        time.sleep(0.05)
    return sup.poll()


def script(place, name: str, body: str) -> str:
    path = place / "scripts" / name
    path.write_text(textwrap.dedent(body))
    path.chmod(0o644)
    return str(path)


def test_a_job_user_cannot_make_the_daemon_write_through_a_planted_agent_log(
        place, job_user, etcd, prefix):
    target = place / "root-only"
    target.write_text("root's secret\n")
    target.chmod(0o600)
    before = (target.read_bytes(), os.stat(target))
    evil = script(place, "evil.py", """
        import os, sys
        log, target, mark = sys.argv[1:]
        if not os.path.exists(mark):  # first run: plant the link, fail, get restarted
            open(mark, "w").close()
            os.unlink(log)
            os.symlink(target, log)
            sys.exit(1)
        print("second run wrote to the log", flush=True)
        """)
    log = str(place / "state" / "jobs" / "evil" / "agent.log")
    args = [log, str(target), str(place / "marks" / "planted")]
    first = supervisor(place, job_user, "evil", evil, args, etcd, prefix, cwd="/")
    first.start()
    assert wait_exit(first) != 0
    first.stop(grace=1)
    assert os.path.islink(log), "the job did not plant its link: the test shows nothing"
    again = supervisor(place, job_user, "evil", evil, args, etcd, prefix, cwd="/")
    again.start()  # the daemon's restart of the agent
    assert wait_exit(again) == 0
    again.stop(grace=1)
    assert target.read_bytes() == before[0], "root wrote through the job user's symlink"
    st = os.stat(target)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    st = os.lstat(log)
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    assert "second run wrote to the log" in open(log).read()


def test_planted_torch_in_the_cwd_runs_in_neither_agent_nor_zygote_scripts_import_beside_them(
        place, job_user, etcd, prefix):
    cwd = place / "cwd"
    (cwd / "torch").mkdir(parents=True)
    (cwd / "torch" / "__init__.py").write_text(textwrap.dedent(f"""
        import os
        open({str(place / 'marks' / 'planted-torch-ran')!r} + "-" + str(os.getpid()), "w")
        raise SystemExit("the planted torch ran")
        """))
    os.chmod(cwd, 0o755)
    script(place, "helper.py", "VALUE = 'imported from beside the script'\n")
    train = script(place, "train.py", """
        import json, os, sys
        import helper  # a module beside the script, as the pytorch/examples scripts do
        with open(sys.argv[1], "w") as fh:
            json.dump({"helper": helper.VALUE, "path0": sys.path[0], "uid": os.getuid(),
                       "warm": "torch" in sys.modules}, fh)
        """)
    result = place / "marks" / "result.json"
    sup = supervisor(place, job_user, "imports", train, [str(result)], etcd, prefix,
                     cwd=str(cwd), warm=True)
    try:
        sup.start()
        zygote, name = sup.zygote, sup.zygote_name
        assert wait_exit(sup) == 0, open(sup.log_path, errors="replace").read()
        # The zygote's socket name is unguessable and not in its argv, which ps shows to all.
        assert len(name) >= 32 and zygote.poll() is None
        with open(f"/proc/{zygote.pid}/cmdline", "rb") as fh:
            assert name.encode() not in fh.read()
        with open(f"/proc/{zygote.pid}/environ", "rb") as fh:
            assert f"{ZYGOTE_ENV}={name}".encode() in fh.read().split(b"\0")
    finally:
        sup.stop(grace=1)
    assert not list((place / "marks").glob("planted-torch-ran*"))
    got = json.loads(result.read_text())
    assert got == {"helper": "imported from beside the script", "path0": str(place / "scripts"),
                   "uid": job_user.pw_uid, "warm": True}


SQUATTER = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\0elasticd-zygote-" + sys.argv[1])
s.listen(8)
print("bound", flush=True)
s.settimeout(30)
conn, _ = s.accept()
conn.settimeout(10)
data, fds = b"", []
try:
    while True:
        chunk, got, _flags, _addr = socket.recv_fds(conn, 1 << 16, 8)
        fds += got
        if not chunk:
            break
        data += chunk
except TimeoutError:  # a worker that handed itself over waits for the pid: stop listening
    pass
print(json.dumps({"bytes": len(data), "fds": len(fds), "secret": b"hunter2" in data}),
      flush=True)
"""


def test_a_squatter_on_the_zygotes_name_gets_nothing_and_the_worker_starts_cold(place):
    name = os.urandom(8).hex()
    job = script(place, "job.py", "import sys; print('ran', sys.argv[1:]); sys.exit(5)\n")
    with temporary_user("edh") as hostile:
        squatter = subprocess.Popen([sys.executable, "-c", SQUATTER, name], user=hostile.pw_uid,
                                    group=hostile.pw_gid, extra_groups=[], cwd="/",
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert squatter.stdout.readline().strip() == "bound", squatter.stderr.read()
            env = {**os.environ, ZYGOTE_ENV: name, "SECRET_TOKEN": "hunter2"}
            worker = subprocess.run([sys.executable, "-m", "elasticd.agent.warm_start", job,
                                     "arg"], env=env, capture_output=True, text=True, timeout=60)
            seen = json.loads(squatter.communicate(timeout=30)[0])
        finally:
            if squatter.poll() is None:
                squatter.send_signal(signal.SIGKILL)
            squatter.wait()
    assert seen == {"bytes": 0, "fds": 0, "secret": False}
    assert f"its server runs as uid {hostile.pw_uid}" in worker.stderr
    assert worker.returncode == 5 and "ran ['arg']" in worker.stdout

"""Warm worker starts: a real zygote (torch imported) forks workers for warm_start clients."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from elasticd.agent.supervisor import safe_module
from elasticd.agent.zygote import ZYGOTE_ENV, Untrusted, address, connect, peer_allowed, send_msg

SCRIPT = """
import os, random, sys, time
print("argv", sys.argv[1:], "env", os.environ.get("FOO"), "cwd", os.getcwd(), "name", __name__,
      "torch-preloaded", "torch" in sys.modules, "random", random.random(), flush=True)
mode = sys.argv[1]
if mode == "sleep":
    with open(sys.argv[2], "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(60)
if mode == "raise":
    raise RuntimeError("boom in the script")
if mode == "ready":  # what a recovering worker must not pay for again (zygote.py, PRELOAD)
    import gc
    store = sys.modules["torch.distributed.rendezvous"]._create_c10d_store
    print("dynamo", "torch._dynamo" in sys.modules, "frozen", gc.get_freeze_count() > 100000,
          "store-wrapped", getattr(store, "elasticd_wrapped", False), flush=True)
    sys.exit(0)
sys.exit(int(mode))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _worker_pid(p: subprocess.Popen, pidfile) -> int:
    """The forked worker's pid, once its script has written it."""
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    return int(pidfile.read_text())


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    name = f"test-{uuid.uuid4().hex[:8]}"
    log = tmp_path_factory.mktemp("zygote") / "zygote.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(safe_module(sys.executable, "elasticd.agent.zygote"),
                                env={**os.environ, ZYGOTE_ENV: name}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Wait until it listens: a worker asking before the bind falls back to a cold start
        # (CI once saw the first test get an interpreter without torch preloaded).
        deadline = time.monotonic() + 60
        while b"ready" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield name
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def warm(name: str, script, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, ZYGOTE_ENV: name, "FOO": kw.pop("foo", "bar")}
    return subprocess.Popen([sys.executable, "-m", "elasticd.agent.warm_start", str(script), *args],
                            env=env, cwd=kw.pop("cwd", None), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def test_the_worker_runs_the_script_with_its_argv_env_cwd_and_exit_code(zygote, script, tmp_path):
    first = warm(zygote, script, "3", cwd=str(tmp_path))
    out, err = first.communicate(timeout=60)
    assert first.returncode == 3, err
    assert f"argv ['3'] env bar cwd {tmp_path} name __main__ torch-preloaded True" in out
    second = warm(zygote, script, "0", foo="baz", cwd="/")
    out2, err2 = second.communicate(timeout=30)
    assert second.returncode == 0, err2
    assert "env baz cwd / " in out2 and "torch-preloaded True" in out2
    # Each fork reseeds Python's generator, as a fresh interpreter would.
    assert out.split("random ")[1] != out2.split("random ")[1]


def test_the_worker_finds_dynamo_loaded_its_gc_frozen_and_the_store_connect_wrapped(zygote,
                                                                                    script):
    # Each of these cost a recovering worker time (zygote.py, store_connect.py): DDP's import
    # of torch._dynamo ~1 s, a full collection over the preloaded objects ~0.3 s, torch's
    # connect back-off 0.25-0.75 s.
    p = warm(zygote, script, "ready")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "dynamo True frozen True store-wrapped True" in out, out + err


def test_a_script_that_raises_exits_1_with_its_traceback(zygote, script):
    p = warm(zygote, script, "raise")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1
    assert "RuntimeError: boom in the script" in err


def test_sigterm_is_forwarded_and_mirrored(zygote, script, tmp_path):
    pidfile = tmp_path / "pid"
    p = warm(zygote, script, "sleep", str(pidfile))
    child = _worker_pid(p, pidfile)
    assert child != p.pid and _alive(child)
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=10)
    assert p.returncode == -signal.SIGTERM
    assert not _alive(child)


def test_sigkill_of_the_stand_in_kills_the_worker(zygote, script, tmp_path):
    pidfile = tmp_path / "pid"
    p = warm(zygote, script, "sleep", str(pidfile))
    child = _worker_pid(p, pidfile)
    p.kill()
    p.wait(timeout=10)
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the worker outlived the process torchrun watches"


def test_without_a_zygote_the_script_starts_cold(script):
    p = warm(f"missing-{uuid.uuid4().hex[:8]}", script, "4")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 4
    assert "unreachable" in err and "starting" in err
    assert "argv ['4']" in out


def test_only_the_zygotes_user_or_root_may_connect():
    assert peer_allowed(1000, 1000) and peer_allowed(0, 1000)
    assert not peer_allowed(1001, 1000)


def _fresh_zygote(tmp_path):
    """A zygote started now (still preloading): its name, log and process (the caller kills
    its group)."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "zygote.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(safe_module(sys.executable, "elasticd.agent.zygote"),
                                env={**os.environ, ZYGOTE_ENV: name}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return name, log, proc


def test_a_request_whose_stand_in_left_while_the_zygote_preloaded_starts_no_worker(script,
                                                                                  tmp_path):
    # torchrun stops a worker group whose warm_starts are still queued behind a preloading
    # zygote when a bigger round comes: the queued request must not become a worker of a group
    # that no longer exists (CI saw a world-2 and a world-3 group train side by side).
    pidfile = tmp_path / "pid"
    name, log, proc = _fresh_zygote(tmp_path)
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 30
        while True:  # the zygote binds first, then imports torch for seconds
            try:
                client.connect(address(name))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.01)
        assert b"ready" not in log.read_bytes(), "the zygote preloaded too fast to test this"
        with open(os.devnull, "rb") as i, open(os.devnull, "wb") as o:
            send_msg(client, {"argv": [str(script), "sleep", str(pidfile)],
                              "env": dict(os.environ), "cwd": str(tmp_path)},
                     [i.fileno(), o.fileno(), o.fileno()])
        client.close()  # warm_start died of torchrun's SIGTERM while it waited
        deadline = time.monotonic() + 60
        while b"request refused" not in log.read_bytes():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        time.sleep(2)  # a forked worker writes its pid at once
        assert not pidfile.exists(), "the zygote started a worker nobody waits for"
    finally:
        if pidfile.exists() and pidfile.read_text():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_wait_ready_answers_once_the_preload_is_done(zygote, tmp_path):
    from elasticd.agent.zygote import wait_ready

    assert wait_ready(zygote, None, 10.0) == ""  # the module's zygote is ready
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    why = wait_ready(missing, None, 0.5)  # nobody bound it: retried until the timeout
    assert "unreachable" in why and 0.4 < time.monotonic() - started < 3.0
    # A zygote started now: the wait ends after it logged "ready", not before.
    name, log, proc = _fresh_zygote(tmp_path)
    try:
        assert wait_ready(name, proc.pid, 60.0) == ""
        assert b"ready" in log.read_bytes()
        assert "not the job's zygote" in wait_ready(name, 1, 5.0)  # pid 1 is not it
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    started = time.monotonic()
    assert "is gone" in wait_ready(name, proc.pid, 30.0) and time.monotonic() - started < 1.0


def test_a_worker_refuses_a_zygote_name_bound_by_another_process():
    """The check before a byte of argv or environment goes out: the server of the name must be
    the zygote's pid (and run as the worker's uid; another uid: test_job_user_isolation)."""
    name = uuid.uuid4().hex
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as squatter:
        squatter.bind(address(name))
        squatter.listen(1)
        with pytest.raises(Untrusted, match=r"its server is pid \d+, not the job's zygote"):
            connect(name, os.getpid() + 1, timeout=5)
        connect(name, os.getpid(), timeout=5).close()  # the expected pid: let through

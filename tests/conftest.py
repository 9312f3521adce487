"""Shared fixtures: a real etcd server per test session, unique key prefixes, and clients.

Tests that need the real server take the ``etcd`` fixture (marked ``etcd``); it is started once
per session on free loopback ports and stopped at the end. Tests that break etcd (SIGSTOP, kill)
take ``private_etcd`` instead, a server of their own.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import uuid

import pytest

from elasticd.coordination.embedded import EmbeddedEtcd
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
_counter = itertools.count()


_TEST_ROOT = "/tmp/elasticd-tests"
_OWN_BASETEMP = pytest.StashKey[str]()  # the session's directory when this conftest made it
_KEEP_SECONDS = 6 * 3600


def pytest_configure(config):
    """As root, ``tmp_path`` lives under a directory the jobs' user can traverse.

    Jobs run as ``elasticd.launcher.JOB_USER`` while the daemons run as root: that user must
    reach the daemons' sockets and write its outputs under the test's directories. pytest's
    own root (``/tmp/pytest-of-root``) is 0700, and every pytest session on the machine resets
    it to 0700, so it cannot simply be opened. Each session gets its own 0711 directory under
    a root-owned 0711 root instead (removed at the end when the session passes); those of
    sessions older than a few hours are removed. In it: ``tmp`` (the basetemp) and
    ``torchinductor``, torch's cache directory (``TORCHINDUCTOR_CACHE_DIR``: importing
    ``torch._dynamo``, as DDP and the zygote do, makes ``/tmp/torchinductor_<user>``
    otherwise), open to every user as the jobs' processes inherit it.
    """
    if config.option.basetemp is not None or os.geteuid() != 0:
        return
    import shutil
    import stat
    import tempfile
    import time

    os.makedirs(_TEST_ROOT, mode=0o711, exist_ok=True)
    st = os.lstat(_TEST_ROOT)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise pytest.UsageError(f"{_TEST_ROOT} is not a root-owned directory only root can "
                                "write; remove it")
    os.chmod(_TEST_ROOT, 0o711)
    for name in os.listdir(_TEST_ROOT):
        old = os.path.join(_TEST_ROOT, name)
        if time.time() - os.lstat(old).st_mtime > _KEEP_SECONDS:
            shutil.rmtree(old, ignore_errors=True)
    session = tempfile.mkdtemp(prefix="run-", dir=_TEST_ROOT)
    os.chmod(session, 0o711)
    config.stash[_OWN_BASETEMP] = session
    config.option.basetemp = os.path.join(session, "tmp")
    inductor = os.path.join(session, "torchinductor")
    os.mkdir(inductor)
    os.chmod(inductor, 0o1777)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor


@pytest.fixture(scope="session", autouse=True)
def _reachable_basetemp(request, tmp_path_factory):
    """pytest empties a given basetemp and makes it again, 0700: opened here, once it exists."""
    if _OWN_BASETEMP in request.config.stash:
        os.chmod(tmp_path_factory.getbasetemp(), 0o711)


@pytest.fixture(autouse=True)
def _a_fresh_worker_process():
    """Tests that run an in-process worker's rounds in the test process leave it "kept"
    (:func:`elasticd.worker.in_process.kept`, a process-wide fact in a real worker): reset, so
    that a later test's restore reports the path of the process it means to be."""
    yield
    in_process = sys.modules.get("elasticd.worker.in_process")
    if in_process is not None:
        in_process._kept = False


def pytest_sessionfinish(session, exitstatus):
    """A session that passed removes the directory it made (its tests' ``tmp_path``: etcd data,
    logs, cluster work directories: gigabytes over the whole suite); one that failed keeps it
    and says where. ``KEEP_TEST_TMP=1`` keeps it always (not an ``ELASTICD_`` name: the daemons
    the tests start inherit the environment and refuse an ``ELASTICD_`` variable that is no
    setting). (``bash .ci/test`` then checks that nothing else is left under /tmp.)"""
    import shutil

    path = session.config.stash.get(_OWN_BASETEMP, None)
    if path is not None and exitstatus == 0 and not os.environ.get("KEEP_TEST_TMP"):
        shutil.rmtree(path, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path = config.stash.get(_OWN_BASETEMP, None)
    if path is not None and os.path.isdir(path):
        terminalreporter.write_line(f"the tests' files are kept in {path}")


@pytest.fixture(scope="session")
def etcd():
    """A single-member etcd shared by the whole session (tests isolate by prefix)."""
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_etcd():
    """An etcd server for one test, which the test may pause, kill and restart."""
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def root():
    """A path under /dev/shm no other test uses, for a slot store's root; removed after the
    test (tests never leave files in /dev/shm)."""
    path = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def prefix():
    """A key prefix no other test uses."""
    return f"/t{next(_counter)}-{uuid.uuid4().hex[:8]}"


def connect(server: EmbeddedEtcd, timeout: float = 1.0) -> EtcdCoordinator:
    return EtcdCoordinator(EtcdSettings(parse_endpoints(server.endpoints), timeout=timeout))


@pytest.fixture
def etcd_client(etcd):
    client = connect(etcd)
    try:
        yield client
    finally:
        client.close()

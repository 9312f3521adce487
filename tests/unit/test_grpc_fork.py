"""gRPC's fork handlers are off before gRPC loads, whichever module of ours loads it first.

The daemon forks children as the job's user (agent, zygote, file check); with gRPC's fork
handlers on, some of those children die of SIGSEGV before their exec (a CI run's file check
did, in a process that had imported the etcd client before the daemon package).
"""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Prints GRPC_ENABLE_FORK_SUPPORT as it is when ``grpc`` is first imported, then imports argv[1].
_SPY = r"""
import importlib, os, sys
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc":
            print("at grpc import:", os.environ.get("GRPC_ENABLE_FORK_SUPPORT"), flush=True)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Spy())
importlib.import_module(sys.argv[1])
"""


@pytest.mark.parametrize("module", [
    "elasticd.coordination.etcd_watch", "elasticd.coordination.etcd_connection",
    "elasticd.coordination.etcd", "elasticd.daemon.main", "elasticd.cli.main"])
def test_fork_support_is_off_when_grpc_is_first_imported(module):
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    done = subprocess.run([sys.executable, "-c", _SPY, module], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stdout.splitlines() if x.startswith("at grpc import:")]
    assert lines == ["at grpc import: false"], done.stdout  # each of them loads grpc


def test_an_operators_setting_is_kept():
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "true"}
    done = subprocess.run([sys.executable, "-c", _SPY, "elasticd.coordination.etcd"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert "at grpc import: true" in done.stdout, (done.stdout, done.stderr)

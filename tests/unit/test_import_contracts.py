"""The package's boundaries, as import contracts (``[tool.importlinter]`` in pyproject.toml).

Runs import-linter's ``lint-imports`` over the source tree: the worker side imports no daemon,
HTTP, CLI, etcd client or grpc; the rendezvous plugin imports only coordination; coordination
imports no checkpoint, replication, agent, daemon or worker; metrics imports no domain module;
the CLI imports no daemon or agent module. A broken contract fails here with import-linter's
report, which names the chain of imports that breaks it.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint), "--no-cache", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout and "5 kept" in res.stdout, res.stdout

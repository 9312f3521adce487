"""Every daemon setting is documented in the settings table and can be given as a flag.

The table is found by its marker, ``<!-- elasticd-settings-table``, in README.md or any page
under docs/ (wherever the guide keeps it); the test reads its first column, compares it with
:class:`elasticd.config.Settings`, and runs ``elasticd --help`` to see a flag for each setting
(the cluster secret itself excepted, on purpose: :data:`elasticd.daemon.main.NO_FLAG`).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest

from elasticd import config
from elasticd.daemon import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = "<!-- elasticd-settings-table"
SETTINGS = [f.name for f in dataclasses.fields(config.Settings)]


def settings_table() -> tuple[str, dict[str, str]]:
    """(the file holding the marked table, {setting: its row}); one marked table in the docs."""
    found = []
    for path in [os.path.join(REPO, "README.md"),
                 *sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]:
        with open(path) as fh:
            lines = fh.read().splitlines()
        found += [(path, lines, i) for i, line in enumerate(lines) if line.startswith(MARKER)]
    assert len(found) == 1, f"expected one {MARKER!r} in README.md and docs/, found " \
                            f"{[p for p, _, _ in found]}"
    path, lines, at = found[0]
    rows: dict[str, str] = {}
    for line in lines[at + 1:]:
        if not line.startswith("|"):
            break
        first = line.split("|")[1]
        for name in re.findall(r"`([a-z_0-9]+)`", first):
            assert name not in rows, f"{name} has two rows in {path}"
            rows[name] = line
    return os.path.relpath(path, REPO), rows


def elasticd_help() -> str:
    """``elasticd --help``, from the installed entry point when it is there."""
    script = os.path.join(os.path.dirname(sys.executable), "elasticd")
    argv = [script] if os.path.exists(script) else [sys.executable, "-m",
                                                      "elasticd.daemon.main"]
    return subprocess.run([*argv, "--help"], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def test_the_settings_table_lists_every_setting_once():
    where, rows = settings_table()
    assert sorted(rows) == sorted(SETTINGS), (
        f"{where}'s settings table: missing {sorted(set(SETTINGS) - set(rows))}, "
        f"unknown {sorted(set(rows) - set(SETTINGS))}")


def test_elasticd_help_lists_a_flag_for_every_setting():
    text = elasticd_help()
    shown = set(re.findall(r"^\s+(--[a-z0-9-]+)", text, re.M))
    missing = [s for s in SETTINGS if s not in main.NO_FLAG and main.flag(s) not in shown]
    assert not missing, f"settings without a flag in elasticd --help: {missing}"
    for name in main.NO_FLAG:
        assert main.flag(name) not in shown
        # ...and the table says why, and how to give it instead.
        assert "no flag" in settings_table()[1][name]


def test_every_flag_reaches_its_setting(tmp_path):
    """The flags the README promised but the parser refused ("unrecognized arguments")."""
    cert = tmp_path / "agent.pem"
    cert.write_text("x")
    argv = ["--job-users", "nobody,root", "--job-python", sys.executable,
            "--job-env-allow", "LD_LIBRARY_PATH", "--agent-etcd-users", "off",
            "--agent-etcd-cert", str(cert), "--agent-etcd-key", str(cert),
            "--memory-cap-mib", "512", "--persist-keep", "4", "--replicas", "3"]
    args = main.build_parser().parse_args(argv)
    s = main._settings(args)
    assert (s.job_users, s.job_python, s.job_env_allow) == ("nobody,root", sys.executable,
                                                            "LD_LIBRARY_PATH")
    assert (s.agent_etcd_users, s.agent_etcd_cert, s.agent_etcd_key) == ("off", str(cert),
                                                                         str(cert))
    assert (s.memory_cap_mib, s.persist_keep, s.replicas) == (512, 4, 3)
    # A flag's bad value names the flag, as for every other setting.
    with pytest.raises(config.ConfigError, match=r"agent_etcd_users \(from --agent-etcd-users\)"):
        main._settings(main.build_parser().parse_args(["--agent-etcd-users", "maybe"]))

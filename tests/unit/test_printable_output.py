"""What workers, peers and etcd writers wrote reaches operators escaped (issue 26, finding 3).

A worker's ``register`` text ends up in the job's status, a crashed worker's exception line in
the crash-loop reason, and anyone who may write etcd picks event details, node sentences and
host names: ``elasticctl`` prints all of them, and the daemon logs many. A terminal acts on an
``ESC ]`` (window title, clipboard), ``ESC [`` (clear, move, recolour) or a carriage return,
and a newline in a log message forges a record. Real CLI commands on the in-memory
coordinator, the daemon's real log formatter and sd_notify line; the real daemon's path (a
worker's ``register`` through the local socket, then ``elasticctl jobs``) is in
``tests/integration/test_hostile_worker.py``.
"""

from __future__ import annotations

import io
import json
import logging
import re
import socket

import pytest

from elasticd.cli import main as cli
from elasticd.cli import options
from elasticd.cluster.events import Event, EventLog
from elasticd.cluster.jobspec import JobControl, JobSpec, JobState
from elasticd.testing.clock import FakeClock
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.daemon.main import Notifier
from elasticd.printable import PrintableFormatter, printable, printable_data

#: What a hostile text carries: a window title with a BEL, a screen clear, a carriage return
#: that hides what came before, a bidi override, a forged log line, DEL, a C1 CSI.
HOSTILE = ("\x1b]0;owned\x07\x1b[2J\rRuntimeError: fine\u202egnp.exe\n"
           "2026-01-01 INFO n1 forged: all good\x7f\x9b31m")
#: A character a terminal or log reader acts on; a newline only where the CLI puts it.
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

KEYS = Keyspace("/elasticd")


def run(coord, *argv: str) -> str:
    args = options.resolve(cli.build_parser().parse_args(
        [*argv[:1], "--etcd", "127.0.0.1:2379", *argv[1:]]))
    out = io.StringIO()
    assert cli._loop(args, coord, KEYS, out) == 0
    return out.getvalue()


def strings(doc) -> list[str]:
    if isinstance(doc, str):
        return [doc]
    values = doc.values() if isinstance(doc, dict) else doc if isinstance(doc, list) else []
    return [s for v in values for s in strings(v)]


@pytest.fixture
def coord(tmp_path):
    """A job whose node status carries a worker's text (its register reason and a crash
    line), and events whose details an etcd writer chose."""
    c = MemoryCoordinator(MemoryStore(FakeClock(1_000.0)))
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    spec = JobSpec(name="j", nnodes_min=1, nnodes_max=1, nproc_per_node=1, script=str(script),
                   args=[], script_sha256="0" * 64, user="nobody", cwd=str(tmp_path))
    c.put(KEYS.job_keys("j").spec, spec.encode())
    c.put(KEYS.job_keys("j").control, JobControl(JobState.RUNNING, 1.0, "t").encode())
    c.put(KEYS.job_keys("j").node("n1"), json.dumps({
        "agent_pid": 0, "agent_starts": 0, "at": 0.0, "detail": HOSTILE, "last_step": -1,
        "log": "/var/log/" + HOSTILE, "node": "n1", "ranks": [0], "record": "node_job_status",
        "schema": 1, "state": "running", "unprotected": "UNPROTECTED: " + HOSTILE,
        "worker_restarts": 0, "world_size": 1}).encode())
    EventLog(c, KEYS).record(Event("failed", "n2", 7, 1_000.0, "n1" + HOSTILE, HOSTILE, {}))
    return c


def test_printable_escapes_what_a_terminal_acts_on_and_nothing_else():
    assert printable("plain text, a path /a/b and a backslash \\ stay") == \
        "plain text, a path /a/b and a backslash \\ stay"
    shown = printable(HOSTILE)
    assert not UNSAFE.search(shown) and "\n" not in shown
    assert shown.startswith("\\x1b]0;owned\\x07\\x1b[2J\\rRuntimeError: fine\\u202egnp.exe\\n")
    assert shown.endswith("all good\\x7f\\x9b31m")
    assert printable("\udcff") == "\\udcff"  # a lone surrogate would fail the print itself
    assert printable_data({"k\x1b": [HOSTILE, 3, None]}) == {"k\\x1b": [shown, 3, None]}


@pytest.mark.parametrize("argv", [["jobs"], ["history"], ["logs", "j"], ["status"]])
def test_elasticctl_prints_foreign_text_escaped(coord, argv):
    if argv == ["status"]:  # status also lists nodes: give it one whose record is hostile
        coord.put(KEYS.node("n1"), HOSTILE.encode())
    text = run(coord, *argv)
    assert not UNSAFE.search(text), repr(text)
    assert "\\x1b]0;owned\\x07" in text  # shown, escaped: the operator sees what was sent


@pytest.mark.parametrize("argv", [["jobs"], ["history"], ["logs", "j"]])
def test_elasticctl_json_escapes_every_control_character_and_keeps_the_value(coord, argv):
    """Held before the fix too (``json.dumps`` escapes them): kept so it stays so."""
    text = run(coord, *argv[:1], "--format", "json", *argv[1:])
    assert not UNSAFE.search(text), repr(text)
    assert any(HOSTILE in v for v in strings(json.loads(text)))  # the exact value, decoded


def test_elasticctl_error_line_is_one_escaped_line(capsys):
    assert cli._fail(1, "job 'j' failed: " + HOSTILE) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not UNSAFE.search(err) and "\\x1b]0;owned" in err


def test_elasticctl_warnings_are_escaped_too():
    """Its warnings quote records it skips (those decoders quote values JSON-escaped today;
    the handler keeps any later warning in line)."""
    err = io.StringIO()
    record = logging.LogRecord("elasticd.cli.main", logging.WARNING, __file__, 1,
                               "elasticctl: ignoring %s", (HOSTILE,), None)
    cli.warnings_to(err).handle(record)
    assert err.getvalue().count("\n") == 1 and not UNSAFE.search(err.getvalue())
    assert err.getvalue().startswith("elasticctl: ignoring \\x1b]0;owned")


def test_a_daemon_log_line_cannot_carry_a_terminal_sequence_or_forge_a_line():
    formatter = PrintableFormatter("%(levelname)s n1 %(name)s: %(message)s")
    record = logging.LogRecord("elasticd.store", logging.ERROR, __file__, 1,
                               "job %s rank %d: cannot be snapshotted: %s", ("j", 0, HOSTILE),
                               None)
    line = formatter.format(record)
    assert "\n" not in line and not UNSAFE.search(line)
    assert line.startswith("ERROR n1 elasticd.store: job j rank 0: cannot be snapshotted: "
                           "\\x1b]0;owned")
    try:
        raise RuntimeError(HOSTILE)
    except RuntimeError:
        import sys
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = formatter.format(record)
    lines = text.split("\n")
    assert lines[1] == "Traceback (most recent call last):"  # the traceback keeps its lines
    assert not any(UNSAFE.search(line) for line in lines) and "\\x1b]0;owned" in lines[-1]


def test_the_daemons_systemd_status_is_one_line(tmp_path):
    path = str(tmp_path / "notify")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    try:
        notifier = Notifier(path)
        notifier.ready("job j refused: script /x\nMAINPID=1\x1b[2J")
        got = server.recv(4096).decode()
        notifier.close()
    finally:
        server.close()
    assert got.split("\n") == ["READY=1", "STATUS=job j refused: script /x\\nMAINPID=1\\x1b[2J"]

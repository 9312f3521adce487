"""``elasticctl`` as a user runs it (a subprocess, against a real etcd): the forms README and
``--help`` show, and every error as one line with the documented exit status (0 ok, 1 failed,
2 bad usage or input, 3 etcd unreachable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from elasticd.cli.main import EVENT_TABLE
from elasticd.cluster.events import Event, EventLog
from elasticd.coordination.keys import Keyspace

pytestmark = [pytest.mark.etcd]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train.py")


def ctl(*args, env=None):
    """Runs elasticctl with no ELASTICD_* variable inherited, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    return subprocess.run([sys.executable, "-m", "elasticd.cli.main", *args],
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=30)


def one_line_error(res, code: int, *needles: str) -> str:
    """The run exited with ``code`` and said one line on stderr holding every needle."""
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("elasticctl: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_cluster_flags_before_and_after_the_command(etcd, prefix):
    ep = etcd.endpoints
    before = ctl("--etcd", ep, "--prefix", prefix, "--format", "json", "nodes")
    after = ctl("nodes", "--etcd", ep, "--prefix", prefix, "--format", "json")
    mixed = ctl("--etcd", ep, "nodes", "--prefix", prefix, "--format", "json")
    from_env = ctl("nodes", "--format", "json", env={"ELASTICD_ETCD": ep,
                                                     "ELASTICD_PREFIX": prefix})
    for res in (before, after, mixed, from_env):
        assert res.returncode == 0 and res.stderr == "", res.stderr
        assert json.loads(res.stdout) == []
    # A flag overrides the environment; after the command it overrides one before it.
    res = ctl("--etcd", "127.0.0.1:9", "status", "--etcd", ep, "--prefix", prefix,
              "--format", "json", env={"ELASTICD_ETCD": "127.0.0.1:9"})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["etcd"] == ep


def test_history_pretty_columns_hold_what_json_holds(etcd, etcd_client, prefix):
    log = EventLog(etcd_client, Keyspace(prefix))
    t = time.time() - 60
    log.record(Event("failed", "n2", 0x12, t, "n1", "n2 failed",
                     {"detection_seconds": 5.213, "heartbeat_at": t - 5}))
    log.record(Event("recovered", "n1", 0x11, t + 3.5, "n1", "j rank 0 restored",
                     {"job": "j", "rank": 0, "source": "peer", "seconds": 0.77,
                      "steps_lost": 1, "step": 96}, instance="a"))
    log.record(Event("recovered", "n3", 0x13, t + 4.0, "n3", "j rank 2 restored",
                     {"job": "j", "rank": 2, "source": "local", "seconds": 0.25,
                      "steps_lost": 0, "step": 97}, instance="b"))
    log.record(Event("joined", "n2", 0x14, t + 20, "n2", "registered"))
    args = ("history", "--etcd", etcd.endpoints, "--prefix", prefix)
    doc = json.loads(ctl(*args, "--format", "json").stdout)
    res = ctl(*args)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.rstrip("\n").splitlines()
    heads = [h for h, _ in EVENT_TABLE.columns]
    assert lines[0].split("  ")[0] == heads[0] and len(lines) == 1 + len(doc) == 5
    starts = [lines[0].index(h) for h in heads]

    def cell(line: str, i: int) -> str:
        end = starts[i + 1] if i + 1 < len(starts) else None
        return line[starts[i]:end].strip()

    filled = 0
    for line, row in zip(lines[1:], doc):
        for i, (head, key) in enumerate(EVENT_TABLE.columns):
            value = row[key]
            want = ("-" if value is None else f"{value:.2f}" if isinstance(value, float)
                    else str(value))
            assert cell(line, i) == want, (head, line, row)
            filled += head in ("DETECT S", "SOURCE", "RESTORE S", "RECOVERY S", "LOST") \
                and value is not None
    # The columns the issue named are filled where the JSON holds a value: detection on the
    # failure, source/restore/recovery/lost on both recoveries.
    assert filled == 1 + 2 * 4, filled
    assert [r["recovery_seconds"] for r in doc if r["kind"] == "recovered"] == [3.5, 4.0]


def test_history_shows_each_recoverys_path_and_its_own_phases(etcd, etcd_client, prefix):
    """Two recoveries written by the daemon's recorder into a real etcd from what it was told
    (an in-process one: its agent's ``reformed`` and its workers' ``reform_moments``; then a
    restart), read by elasticctl as a user runs it: the path in the table, each path's phases
    on its line, the same in JSON."""
    from elasticd.cluster import timeline
    from elasticd.daemon.recovery_timeline import TimelineRecorder
    from elasticd.metrics import Metrics
    from elasticd.testing.clock import FakeClock

    clock = FakeClock(1_000.0, wall_offset=time.time() - 1_100.0)
    keys = Keyspace(prefix)
    log = EventLog(etcd_client, keys)
    rec = TimelineRecorder("n1", etcd_client, keys, log, Metrics(), clock, lambda: 2.0)

    def fail(lease: int) -> None:
        rec.on_progress({"job": "j", "step": 39, "_peer": {"pid": 11}})
        clock.advance(0.1)
        log.record(Event("failed", "n2", lease, clock.wall(), "n3", "n2 failed",
                         {"detection_seconds": 2.0}))
        rec.on_failure("j", "n2", lease, writer=True, aborted=lease != 0x2B)

    def recover(pid: int) -> None:
        clock.advance(0.2)
        rec.on_restore({"job": "j", "rank": 0, "step": 40})
        log.record(Event("recovered", "n1", 1, clock.wall(), "n1", "restored",
                         {"job": "j", "rank": 0, "source": "local", "seconds": 0.05,
                          "steps_lost": 0, "step": 40}, instance=str(pid)))
        clock.advance(0.02)
        rec.on_progress({"job": "j", "step": 41, "_peer": {"pid": pid}})
        assert rec.step() == "recovery timeline of j written"

    fail(0x2B)  # in-process: the agent's and the workers' moments, then the restore
    clock.advance(0.01)
    closed = clock.wall()
    rec.on_reform_moments({"job": "j", "_peer": {"pid": 11},
                           "times": {"group_made": closed + 0.04}})
    rec.on_reformed({"job": "j", "path": "in_process", "times": {"round_closed": closed}})
    recover(11)  # the same process trains again
    clock.advance(100)
    fail(0x3C)  # the restart path (no word from an agent), a new worker
    clock.advance(0.3)
    rec.on_round_closed("j")
    recover(22)

    args = ("history", "--etcd", etcd.endpoints, "--prefix", prefix, "--kind", "timeline")
    doc = json.loads(ctl(*args, "--format", "json").stdout)
    inproc, restart = (r["timeline"] for r in doc)
    assert (inproc["path"], restart["path"]) == ("in_process", "restart")
    assert set(inproc["path_phases"]) == set(timeline.IN_PROCESS_PHASES)
    assert inproc["path_phases"]["group"] == 0.04 and inproc["reform"]["round_closed"] > 0
    assert restart["path_phases"] == restart["phases"]
    res = ctl(*args)
    assert res.returncode == 0, res.stderr
    table = res.stdout.split("first step):\n")[1].splitlines()
    assert table[0].split()[:4] == ["WHEN", "JOB", "FAILED", "PATH"]
    assert [line.split()[3] for line in table[1:3]] == ["in-process", "restart"]
    paths = [line for line in res.stdout.splitlines() if line.startswith("  path ")]
    assert paths[0].startswith("  path in-process (seconds): detect ")
    assert ", round closed 0.010, group 0.040, restore 0.160, first step 0.020" in paths[0]
    assert paths[1].startswith("  path restart (seconds): detect ")
    assert "rendezvous 0.300, start 0.150, restore 0.050, first step 0.020" in paths[1]


def _self_signed(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=elasticctl-test"],
                   check=True, capture_output=True, timeout=30)
    return str(cert), str(key)


def test_unusable_tls_files_are_one_line(etcd, tmp_path):
    res = ctl("nodes", "--etcd", etcd.endpoints, "--etcd-ca-cert", "/nonexistent")
    one_line_error(res, 2, "--etcd-ca-cert '/nonexistent': no such file",
                   "give the path of the CA certificate")
    res = ctl("--etcd", etcd.endpoints, "nodes", env={"ELASTICD_ETCD_CA_CERT": str(tmp_path)})
    one_line_error(res, 2, f"ELASTICD_ETCD_CA_CERT {str(tmp_path)!r}: is a directory")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    # gRPC printed four lines of its own for this one before the CLI's error
    res = ctl("nodes", "--etcd", etcd.endpoints, "--etcd-ca-cert", str(garbage))
    one_line_error(res, 2, f"--etcd-ca-cert {str(garbage)!r}: not a PEM certificate")
    cert, key = _self_signed(tmp_path)
    res = ctl("nodes", "--etcd", etcd.endpoints, "--etcd-ca-cert", cert, "--etcd-cert", cert)
    one_line_error(res, 2, "--etcd-cert and --etcd-key go together")
    res = ctl("nodes", "--etcd", etcd.endpoints, "--etcd-cert", cert, "--etcd-key", key)
    one_line_error(res, 2, "--etcd-cert needs --etcd-ca-cert")
    res = ctl("nodes", "--etcd", etcd.endpoints, "--etcd-ca-cert", cert, "--etcd-cert", cert,
              "--etcd-key", cert)
    one_line_error(res, 2, f"--etcd-key {cert!r}: not a PEM private key")
    # Good files, but this etcd speaks plain http: unreachable over TLS, and said so.
    res = ctl("nodes", "--etcd", etcd.endpoints, "--etcd-ca-cert", cert, "--etcd-cert", cert,
              "--etcd-key", key, "--etcd-timeout", "1")
    one_line_error(res, 3, "check --etcd", "--etcd-ca-cert signed")


@pytest.mark.parametrize("value,needle", [
    ("0", "--etcd-timeout: 0 is out of range: use 0.1 to 600 seconds"),
    ("-1", "--etcd-timeout: -1 is out of range"),
    ("nan", "--etcd-timeout: 'nan' is not a finite number of seconds"),
])
def test_bad_etcd_timeout_against_a_healthy_etcd_is_bad_usage(etcd, value, needle):
    res = ctl("--etcd", etcd.endpoints, "nodes", "--etcd-timeout", value)
    one_line_error(res, 2, needle, "elasticctl nodes --help")


def test_nan_hang_timeout_is_refused_and_nothing_written(etcd, etcd_client, prefix):
    res = ctl("--etcd", etcd.endpoints, "--prefix", prefix, "submit", "j", "--nnodes", "1",
              "--nproc-per-node", "1", "--user", "nobody", "--hang-timeout", "nan", "--", TRAIN)
    one_line_error(res, 2, "--hang-timeout: 'nan' is not a finite number of seconds")
    assert etcd_client.get_prefix(prefix.encode())[0] == []


def test_operation_failed_is_exit_1_and_unreachable_etcd_exit_3(etcd, prefix):
    res = ctl("stop", "nojob", "--force", "--etcd", etcd.endpoints, "--prefix", prefix)
    one_line_error(res, 1, "no job named 'nojob'", "elasticctl jobs")
    res = ctl("--etcd", "127.0.0.1:9", "--etcd-timeout", "0.5", "nodes")
    one_line_error(res, 3, "unreachable", "check --etcd", "endpoint health")


def test_usage_errors_are_one_line_exit_2():
    one_line_error(ctl("nodes"), 2, "no etcd endpoint: pass --etcd HOST:PORT")
    one_line_error(ctl(), 2, "required: COMMAND", "elasticctl --help")
    one_line_error(ctl("--etcd", "127.0.0.1:9", "nodez"), 2, "invalid choice: 'nodez'")
    one_line_error(ctl("stop", "j", "--watch", "1", "--etcd", "127.0.0.1:9"), 2,
                   "--watch does not apply to stop")


def test_reader_closing_the_pipe_ends_watch_quietly(etcd, prefix):
    """``elasticctl nodes --watch 0.1 | head -1``: exit 0, nothing on stderr."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    proc = subprocess.Popen([sys.executable, "-m", "elasticd.cli.main", "nodes", "--watch",
                             "0.1", "--format", "json", "--etcd", etcd.endpoints, "--prefix",
                             prefix], env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "[]"
        proc.stdout.close()
        assert proc.wait(timeout=20) == 0
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def _readme_examples() -> list[list[str]]:
    """The commands of README's elasticctl block, as argv lists (comments dropped)."""
    with open(os.path.join(REPO, "README.md")) as fh:
        text = fh.read()
    block = text.split("\n### elasticctl\n", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].split()[1:] for line in block.splitlines()
            if line.startswith("elasticctl ")]


def test_readme_examples_run_as_written(etcd, prefix):
    """Each README example against a real etcd (its address put in for 10.0.0.5:2379, the
    prefix from the environment, --watch run once): exit 0, or 1 with one line where the
    example names a job or node this empty cluster lacks."""
    examples = _readme_examples()
    assert any(argv[:2] == ["--etcd", "10.0.0.5:2379"] for argv in examples), examples
    ran = 0
    for argv in examples:
        if "--undo" in argv or "--force" in argv:
            continue  # they change the cluster; drain is exercised in test_drain.py
        argv = [etcd.endpoints if a == "10.0.0.5:2379" else a for a in argv]
        watch = argv.index("--watch") if "--watch" in argv else None
        if watch is not None:
            del argv[watch:watch + 2]
        res = ctl(*argv, env={"ELASTICD_ETCD": etcd.endpoints, "ELASTICD_PREFIX": prefix})
        if argv[0] in ("placement", "checkpoints"):
            one_line_error(res, 1, "no job named 'mnist'", "elasticctl jobs")
        else:
            assert res.returncode == 0 and res.stderr == "", (argv, res.stderr)
        ran += 1
    assert ran >= 5

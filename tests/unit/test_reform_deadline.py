"""The in-process re-formation deadline is a job spec field (issue 31): ``reform_deadline``,
``elasticctl submit --reform-deadline``, checked with a one-line error, handed to the job's
agent (``ELASTICD_REFORM_DEADLINE``) and to the daemon's backstop.

Each fails on the code before the field: the spec had no such field, the CLI no such option,
the agent and the daemon a constant 10 s."""

from __future__ import annotations

import json
import pwd
import subprocess
import sys

import pytest

from elasticd.agent import in_process_agent, job_rules
from elasticd.agent.job_rules import JobBook
from elasticd.agent.supervisor import REFORM_DEADLINE_ENV, AgentSupervisor
from elasticd.cli.jobs import SPEC_OPTIONS
from elasticd.cli.main import build_parser
from elasticd.cluster.jobspec import DEFAULT_REFORM_DEADLINE, JobSpec, JobSpecError
from elasticd.coordination import records


def _spec(**fields) -> JobSpec:
    return JobSpec(name="j", nnodes_min=1, nnodes_max=2, nproc_per_node=1, script=sys.executable,
                   args=[], script_sha256="0" * 64, user=pwd.getpwuid(0).pw_name, cwd="/",
                   **fields)


def test_the_deadline_defaults_to_10_s_and_specs_written_before_it_decode_so():
    assert _spec().reform_deadline == DEFAULT_REFORM_DEADLINE == 10.0
    body = json.loads(_spec(reform_deadline=4.5).encode())
    assert body["reform_deadline"] == 4.5
    assert JobSpec.decode(json.dumps(body).encode(), job="j").reform_deadline == 4.5
    del body["reform_deadline"]  # a spec written before the field
    assert JobSpec.decode(json.dumps(body).encode(), job="j").reform_deadline == 10.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 3600.5])
def test_a_bad_deadline_is_refused_in_one_line_naming_the_option(bad):
    with pytest.raises(JobSpecError) as err:
        _spec(reform_deadline=bad).check_fields()
    text = str(err.value)
    assert text.startswith(f"--reform-deadline {bad}: use more than 0 to 3600 seconds")
    assert "\n" not in text
    # The same check where a spec is read (anyone who may write etcd may write one).
    body = json.loads(_spec().encode())
    body["reform_deadline"] = -1
    with pytest.raises(records.CorruptRecord, match="--reform-deadline -1"):
        JobSpec.decode(json.dumps(body).encode(), job="j")


def test_submit_takes_the_option_into_the_spec_and_refuses_bad_values_in_one_line():
    parser = build_parser()
    base = ["submit", "j", "--nnodes", "1", "--nproc-per-node", "1"]
    assert parser.parse_args([*base, "/x.py"]).reform_deadline == 10.0
    assert parser.parse_args([*base, "--reform-deadline", "2.5", "/x.py"]).reform_deadline == 2.5
    assert "reform_deadline" in SPEC_OPTIONS  # handed to jobspec.build as the field
    for bad, said in (("0", "out of range: use more than 0 to 3600 seconds (default 10)"),
                      ("nan", "'nan' is not a finite number of seconds"),
                      ("soon", "'soon' is not a number of seconds")):
        out = subprocess.run([sys.executable, "-m", "elasticd.cli.main", *base,
                              "--reform-deadline", bad, "/x.py"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "--reform-deadline" in lines[0] and said in lines[0], lines


def test_the_agent_of_an_in_process_job_gets_the_deadline_and_reads_it():
    inproc = AgentSupervisor(_spec(in_process=True, reform_deadline=2.5), "n1", "tag",
                             "127.0.0.1:2379", "/elasticd", "/tmp/logs")
    env = inproc.env()
    assert env[REFORM_DEADLINE_ENV] == "2.5"
    assert in_process_agent.reform_deadline(env) == 2.5
    plain = AgentSupervisor(_spec(), "n1", "tag", "127.0.0.1:2379", "/elasticd", "/tmp/logs")
    assert REFORM_DEADLINE_ENV not in plain.env()
    # A daemon before the field gives none: the agent keeps the old constant.
    assert in_process_agent.reform_deadline({}) == DEFAULT_REFORM_DEADLINE
    assert in_process_agent.reform_deadline({REFORM_DEADLINE_ENV: "junk"}) == 10.0


def test_the_daemons_backstop_is_the_jobs_deadline_plus_the_round_allowance():
    book = JobBook()
    book.reform_started(100.0, 3.0)
    by = 100.0 + 3.0 + job_rules.REFORM_ROUND_ALLOWANCE
    assert not book.reform_overdue(by - 0.01)
    assert book.reform_overdue(by)


"""The in-process mode is opt-in per job (issue 31): a job spec field, ``elasticctl submit
--in-process``, and specs written before it decode as not in the mode."""

from __future__ import annotations

import json
import sys

from elasticd.cli.jobs import SPEC_OPTIONS
from elasticd.cli.main import build_parser
from elasticd.cluster.jobspec import JobSpec


def _spec(**fields) -> JobSpec:
    return JobSpec(name="j", nnodes_min=1, nnodes_max=2, nproc_per_node=1, script=sys.executable,
                   args=[], script_sha256="0" * 64, user="root", cwd="/", **fields)


def test_a_spec_is_not_in_process_unless_asked_and_old_records_decode_so():
    assert _spec().in_process is False
    body = json.loads(_spec().encode())
    assert body["in_process"] is False
    del body["in_process"]  # a spec written before the field
    assert JobSpec.decode(json.dumps(body).encode(), job="j").in_process is False
    assert JobSpec.decode(_spec(in_process=True).encode(), job="j").in_process is True


def test_submit_in_process_sets_the_field_and_is_off_by_default():
    parser = build_parser()
    base = ["submit", "j", "--nnodes", "1", "--nproc-per-node", "1"]
    assert parser.parse_args([*base, "/x.py"]).in_process is False
    assert parser.parse_args([*base, "--in-process", "/x.py"]).in_process is True
    assert "in_process" in SPEC_OPTIONS  # handed to jobspec.build as the field

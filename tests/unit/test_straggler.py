"""The straggler verdict (elasticd.agent.straggler); its wiring: tests/unit/test_job_manager.py."""

from __future__ import annotations

import random
import re

import pytest

from elasticd.agent.straggler import StragglerJudge


def _run(judge, mine, others, steps, start=0):
    out = None
    for step in range(start, start + steps):
        out = judge.observe(step, mine(step) if callable(mine) else mine, others)
    return out


def test_a_node_persistently_slower_is_named_after_its_steps_and_only_then():
    judge = StragglerJudge(factor=1.5, steps=20)
    others = {"n1": 0.10, "n3": 0.11}
    assert not judge.observe(0, 0.30, others).named
    assert not _run(judge, 0.30, others, 19, start=1).named  # slower since step 0
    v = judge.observe(20, 0.30, others)  # for 20 steps
    assert v.named and round(v.ratio, 2) == round(0.30 / 0.105, 2)
    assert v.text.startswith("STRAGGLER: compute 0.3 s/step, 2.9x the median 0.105 s of n1, n3")


def test_within_the_factor_or_a_tiny_gap_never_names_and_noise_does_not_flap():
    rng = random.Random(7)
    judge = StragglerJudge(factor=1.5, steps=10)
    others = {"n1": 0.10, "n3": 0.10}
    # Steps varying 3x around the others' median, one sample at a time above the line.
    for step in range(500):
        mine = rng.choice([0.05, 0.10, 0.16])
        assert not judge.observe(step, mine, others).named
    tiny = StragglerJudge(factor=1.5, steps=2, min_gap=0.005)
    assert not _run(tiny, 0.003, {"n1": 0.001}, 50).named  # 3x, but 2 ms a step


def test_a_named_node_is_cleared_only_after_steps_within_and_a_restart_keeps_the_verdict():
    judge = StragglerJudge(factor=1.5, steps=5)
    others = {"n1": 0.1}
    assert _run(judge, 0.3, others, 7).named
    assert judge.observe(None, None, others).named  # restarting: no step, nothing judged
    assert _run(judge, 0.1, others, 5, start=10).named
    assert not _run(judge, 0.1, others, 2, start=15).named
    assert judge.observe(17, 0.1, others).text == ""


def test_nothing_to_compare_names_nobody_and_factor_zero_is_off():
    assert not _run(StragglerJudge(), 0.3, {}, 100).named
    assert not _run(StragglerJudge(), 0.3, {"n1": 0.0}, 100).named  # peers not measuring
    assert not _run(StragglerJudge(factor=0), 9.0, {"n1": 0.1}, 100).named



@pytest.mark.parametrize("change,needle", [
    ({"straggler_factor": 1.0}, "--straggler-factor 1.0: use more than 1"),
    ({"straggler_factor": -2.0}, "--straggler-factor -2.0"),
    ({"straggler_steps": 0}, "--straggler-steps 0: use 1 to 100000"),
])
def test_a_bad_straggler_setting_is_a_one_line_error(change, needle):
    import dataclasses
    import sys

    from elasticd.cluster.jobspec import JobSpec, JobSpecError

    spec = JobSpec(name="job", nnodes_min=1, nnodes_max=2, nproc_per_node=1,
                   script=sys.executable, args=[], script_sha256="0" * 64, user="root",
                   cwd="/")
    spec.check_fields()
    assert spec.straggler_factor == 1.5 and not spec.straggler_drain  # on, not draining
    with pytest.raises(JobSpecError, match=re.escape(needle)):
        dataclasses.replace(spec, **change).check_fields()

"""The README is a user's guide: short, in a newcomer's order, two set-up commands, and every
command block either run by a named test (which reads it from the README, so the two cannot
drift) or marked as not run with the reason (several hosts, systemd, GPUs)."""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")
#: The guide's sections, in order.
SECTIONS = ["## Quick start", "## Concepts", "## Your own script on one machine",
            "## Running a node on a cluster", "## Operations", "## Documentation"]
#: The section (its nearest heading) -> the test that runs its command blocks, reading them
#: from the README by that heading.
RUN_BY = {
    "## Your own script on one machine": "tests/integration/test_onehost.py",
    "### Several GPUs per node on one host": "tests/integration/test_onehost.py",
    "### What to change in your script": "tests/integration/test_readme_snippet.py",
    "### elasticctl": "tests/integration/test_elasticctl_cli.py",
}
NOT_RUN = re.compile(r"<!-- not run: [^>]+ -->")


def blocks(text: str) -> list[tuple[str, str, str, str]]:
    """(nearest heading, the line before the block, language, body) of every fenced block."""
    out, heading, before = [], "", ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line
        if line.startswith("```"):
            lang, body = line[3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append((heading, before, lang, "\n".join(body)))
        before = line
        i += 1
    return out


def test_the_readme_is_a_short_guide_in_a_newcomers_order():
    text = open(README).read()
    assert len(text.splitlines()) < 350
    at = [text.index(f"\n{s}\n") for s in SECTIONS]
    assert at == sorted(at), "the guide's sections are out of order"


def test_two_set_up_commands_one_for_the_demo_one_for_the_tests():
    text = open(README).read()
    quick = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    assert [b for _, _, lang, b in blocks(quick) if lang == "sh"] == [
        "bash examples/demo.sh", "bash .ci/test"]
    # What each runs: the demo tests/integration/test_demo.py runs, the suite CI runs.
    demo = open(os.path.join(REPO, "examples", "demo.sh")).read().strip().splitlines()
    assert demo[-1] == 'exec .venv/bin/python -m elasticd.demo "$@"'
    assert "bash .ci/install" in demo
    assert "bash .ci/test" in open(os.path.join(REPO, ".ci", "run")).read()


def test_every_command_block_is_run_by_a_test_or_marked_not_run():
    unaccounted = []
    for heading, before, lang, body in blocks(open(README).read()):
        if not lang or heading == "## Quick start":
            continue  # program output; the set-up commands are checked above
        if NOT_RUN.fullmatch(before.strip()):
            continue
        test = RUN_BY.get(heading)
        if test is None or heading not in open(os.path.join(REPO, test)).read():
            unaccounted.append((heading, body.splitlines()[0]))
    assert not unaccounted, f"blocks no test runs and none marked not run: {unaccounted}"


def test_the_checker_sees_an_unmarked_block():
    text = "## X\n\n```sh\nrm -rf /\n```\n\n<!-- not run: a reason -->\n```sh\nok\n```\n"
    got = blocks(text)
    assert [(h, lang, b) for h, _, lang, b in got] == [("## X", "sh", "rm -rf /"),
                                                      ("## X", "sh", "ok")]
    assert not NOT_RUN.fullmatch(got[0][1]) and NOT_RUN.fullmatch(got[1][1])

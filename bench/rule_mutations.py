"""Each safety rule removed once makes a test fail (issue 28): the pure rules of
elasticd/daemon/node_rules.py and elasticd/agent/job_rules.py, each mutated alone in a copy of
the committed tree, with its unit tests run against the copy.

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/rule_mutations.py

Prints one line per mutation ("caught" or "MISSED") and the count; exits 1 if any is missed.
The result is committed in bench/results/rule_mutations.txt.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]

#: (file, the tests that must catch it, the rule's text, the text without the rule)
MUTATIONS = [
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '            if lease in declared:',
     '            if False:'),
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '            elif now > until:',
     '            elif False:'),
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '        if grace and outage_seconds > grace:',
     '        if outage_seconds > grace:'),
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '        if self.fenced:\n            return None',
     '        if False:\n            return None'),
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '        was, self.fenced = self.fenced, False',
     '        was = self.fenced'),
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '        self.suspects.clear()',
     '        pass'),
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '    if first:\n        steps.append(Recover.RECORD_EVENT)',
     '    steps.append(Recover.RECORD_EVENT)'),
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '    return again or looked_at_cycle != cycle',
     '    return True'),
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '        return RecordWrite.NONE if leaving else RecordWrite.REGISTER',
     '        return RecordWrite.REGISTER'),
    ('elasticd/daemon/node_rules.py', 'tests/unit/test_node_rules.py',
     '            and since_write >= SENTENCE_PUBLISH_INTERVAL)',
     '            )'),
    ('elasticd/agent/job_rules.py', 'tests/unit/test_job_rules.py',
     '    if hold:\n        return None',
     '    if False:\n        return None'),
    ('elasticd/agent/job_rules.py', 'tests/unit/test_job_rules.py',
     '        if job in view.finished or',
     '        if False or'),
    ('elasticd/agent/job_rules.py', 'tests/unit/test_job_rules.py',
     '        if job != running and held(job):',
     '        if held(job):'),
    ('elasticd/agent/job_rules.py', 'tests/unit/test_job_rules.py',
     '    if running in view.unreadable:',
     '    if False:'),
    ('elasticd/agent/job_rules.py', 'tests/unit/test_job_rules.py',
     '    if failures > agent_restarts:',
     '    if failures >= agent_restarts:'),
    ('elasticd/agent/job_rules.py', 'tests/unit/test_job_rules.py',
     '    if succeeded_elsewhere:\n        return AgentExit.SUCCEEDED_ELSEWHERE',
     '    if False:\n        return AgentExit.SUCCEEDED_ELSEWHERE'),
    ('elasticd/agent/job_rules.py', 'tests/unit/test_job_rules.py',
     '    if peer != "*" and reformed_without():',
     '    if reformed_without():'),
    ('elasticd/agent/job_rules.py', 'tests/unit/test_job_rules.py',
     '    return mine in pids and theirs not in pids',
     '    return mine in pids'),
    ('elasticd/agent/job_rules.py', 'tests/unit/test_job_rules.py',
     '    if view.desired.get(job) == JobState.FAILED:\n        return JobState.FAILED',
     '    if False:\n        return JobState.FAILED'),
]


def main() -> int:
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        for path, test, old, new in MUTATIONS:
            target = pathlib.Path(tmp, path)
            original = target.read_text()
            assert original.count(old) == 1, (path, old)
            target.write_text(original.replace(old, new))
            try:
                res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p",
                                      "no:cacheprovider", test], cwd=tmp, capture_output=True,
                                     env={**os.environ, "PYTHONPATH": tmp})
            finally:
                target.write_text(original)
            caught = res.returncode != 0
            missed += not caught
            print(("caught  " if caught else "MISSED  ") + f"{path}: {old.strip()[:60]!r}",
                  flush=True)
    print(f"{len(MUTATIONS) - missed}/{len(MUTATIONS)} rule removals make a test fail")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

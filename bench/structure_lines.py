"""Net lines under ``elasticd/`` over issue 28's commits (structure), not counting lines only
moved: ``python bench/structure_lines.py > bench/results/structure_lines.txt``.

The issue's work landed as branches merged into main (each counted as the merge's diff against
main before it, ``git diff M^1 M``: exactly what the branch brought, its conflict resolutions
included, and none of main's work merged into the branch meanwhile) and as commits made on main
itself (``git diff C^ C``), and a branch not merged yet as its range (``git diff A B``: a
merged branch's range would also hold the other work merged into main after it).
:data:`UNITS` lists them, each with why it belongs to the issue.

Per unit, under ``elasticd/``: lines added and deleted (``git diff -M``: a renamed file counts
only its changed lines). A line moved between ``elasticd/`` and the rest of the repository
(a test double going to ``tests/``, a test helper coming into the package) is no real addition
or deletion: a non-blank line deleted under ``elasticd/`` whose exact text (indentation
stripped) is added outside it in the same unit is counted as moved out, not deleted, and the
other way round. A line moved within ``elasticd/`` is added once and deleted once: it cancels in
the net by itself.
"""

from __future__ import annotations

import collections
import subprocess
import sys

#: (revision, kind, why it belongs to issue 28). kind "merge": the branch's diff against main.
UNITS = [
    ("a2de8af", "merge", "branch struct: node and job rules pure, layered imports, typed "
                         "metrics, rule mutations"),
    ("0ea8796", "merge", "branch doubles: test doubles into elasticd/testing/"),
    ("d20395a", "merge", "branch sizes: SlotStore, CheckpointService, Checkpointer off KNOWN"),
    ("da36b25", "commit", "the daemon's peer watch and cycle state as parts (class limits)"),
    ("a72bad9", "merge", "branch jm: the job manager's parts owned, not inherited"),
    ("1a1951a", "merge", "branch split28: Closer, ReplicaServer off KNOWN"),
    ("da61927", "merge", "branch split22: the rendezvous handler off KNOWN"),
    ("15a6c92", "merge", "branch split23: Keyspace views, EtcdConnection, rendezvous settings"),
    ("afb71e5", "merge", "branch metrics23: metric groups, election lease, dead stats"),
    ("6a9029e", "commit", "the key view the Keyspace split made per key, once per event"),
    ("6c7fe6a", "merge", "branch struct24: tracker and reporter split, dead stats, "
                         "metric names, the etcd-only interface"),
    ("3edcaf3", "merge", "branch struct25: dead and test-only code, docstrings that "
                         "restate the code"),
    ("4b26062", "merge", "branch struct26: counters only tests read, code written twice, "
                         "wrappers, docstrings that restate the code"),
    ("68b5004", "commit", "the replication's optional members in its protocol, not probed "
                          "with getattr"),
    ("8f81020", "commit", "the worker's Collective and Transport as base classes, not probed "
                          "with getattr"),
    ("efc60db..20a7176", "range", "branch struct28: code written twice (settings' ranges, "
                                  "the zygote's checked connect), docstrings that restate "
                                  "docs/ or the code"),
    ("376703c..393febe", "range", "branch struct29: an unused switch (the tag pass's helper "
                                  "thread), forwarders and a re-export module, a test-only "
                                  "method, docstrings that restate docs/"),
    ("a5670a3..b8b822d", "range", "branch struct30: one call_hooks for six hook loops, the "
                                  "keyspace's fixed keys one line each, four one-class "
                                  "modules back beside their only user, docstrings that "
                                  "restate docs/ or carry measurement history"),
    ("2bcbcc8..8cba341", "range", "branch struct31: options and rules only tests reached (the "
                                  "local socket's allowed uids, the start-up hang deadline, "
                                  "Clock.wait's wake), a stand-in for enum.StrEnum, dead "
                                  "state, the failure evidence's words written twice, "
                                  "wrappers that restated their rule"),
    ("136cdf1", "merge", "branch struct36a: agent/, daemon/, cli/, local/ and the top-level "
                         "modules: test-only and dead code, code written twice (the "
                         "launcher's kill loops, /proc/<pid>/stat parsing), forwarders, "
                         "docstrings that restate docs/ or the code"),
    ("4ac293b", "merge", "branch struct36b: replication/, recovery/, store/, persistence/: "
                         "test-only and dead code (seal.Opener, Task.source), code written "
                         "twice, one-use helpers, docstrings that restate the code"),
    ("7bf7370", "merge", "branch struct36c: worker/, rendezvous/, coordination/, cluster/, "
                         "snapshot/, testing/: docstrings that restate docs/, parameters no "
                         "caller sets, fields only tests set"),
    ("37b368d", "merge", "branch struct37a: agent/, daemon/, local/: code written twice (the "
                         "zygote's framing, the in-process agent's signal relay), one-class "
                         "modules back beside their only user, fields only tests read, "
                         "docstrings that restate the signature"),
    ("a866439", "merge", "branch struct37b: replication/, recovery/, persistence/: code only "
                         "tests reached (AuthFailures.count, CommitTracker.on_ack), checks "
                         "written twice, a branch on a constant, restating docstrings"),
    ("ca631f3", "merge", "branch struct37c: worker/, store/, snapshot/: reader and layout "
                         "methods only tests called, the cap and ownership checks written "
                         "twice, per-case code as tables, re-raising try layers"),
    ("b048589", "merge", "branch struct37d: rendezvous/, coordination/, cluster/, cli/, "
                         "top-level: one-use helpers, code written twice, per-field checks as "
                         "a table, dead parameters, restating docstrings"),
    ("b55fa88", "merge", "branch struct38a: replication/, recovery/, persistence/, second "
                         "round: fields and methods only tests read (PushResult, "
                         "CommitBook.landed, Flushed's ranks), forwarders, a class holding one "
                         "callable, the nonce struct written twice"),
    ("d891209", "merge", "branch struct38c: rendezvous/, coordination/, cluster/, cli/, "
                         "top-level, second round: Raises/Returns sections that repeat the "
                         "raise below or the module paragraph, one-use helpers, dead defaults"),
    ("a87b0c0", "merge", "branch struct38d: agent/, daemon/, local/, second round: internal "
                         "__all__ lists, options and returns only tests reached, a one-class "
                         "module back beside its only user, a wrapper"),
    ("a6028f8", "merge", "branch struct38b: worker/, store/, snapshot/, second round: fields "
                         "and methods only tests read (OverBudget's, history, retained), an "
                         "abstract class with one implementation, a forwarder"),
]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def diff_range(rev: str, kind: str) -> tuple[str, str]:
    if kind == "merge":
        return f"{rev}^1", rev
    if kind == "commit":
        return f"{rev}^", rev
    a, b = rev.split("..")
    return a, b


def count(a: str, b: str) -> dict[str, int]:
    """Lines added and deleted under elasticd/ between ``a`` and ``b``, and those moved."""
    inside = {"+": collections.Counter(), "-": collections.Counter()}
    outside = {"+": collections.Counter(), "-": collections.Counter()}
    path = ""
    for line in git("diff", "-M", "--no-color", "-U0", a, b).splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else path
        elif line.startswith("--- "):
            path = line[6:] if line.startswith("--- a/") else ""
        elif line.startswith("diff --git"):
            path = line.split(" b/", 1)[1]
        elif line[:1] in "+-" and not line.startswith(("+++", "---")):
            side = inside if path.startswith("elasticd/") else outside
            side[line[0]][line[1:].strip()] += 1
    added, deleted = sum(inside["+"].values()), sum(inside["-"].values())
    moved_out = sum(min(n, outside["+"][t]) for t, n in inside["-"].items() if t)
    moved_in = sum(min(n, outside["-"][t]) for t, n in inside["+"].items() if t)
    return {"added": added, "deleted": deleted, "moved_in": moved_in, "moved_out": moved_out,
            "net": (added - moved_in) - (deleted - moved_out)}


def main() -> None:
    head = git("rev-parse", "--short", "HEAD").strip()
    print(f"Net lines under elasticd/ over issue 28's units, at {head} "
          "(command: python bench/structure_lines.py; method in its docstring)\n")
    print(f"{'unit':<16}{'added':>7}{'deleted':>9}{'moved in':>10}{'moved out':>11}{'net':>7}"
          "  what")
    total: collections.Counter[str] = collections.Counter()
    for rev, kind, why in UNITS:
        c = count(*diff_range(rev, kind))
        total.update(c)
        print(f"{rev:<16}{c['added']:>7}{c['deleted']:>9}{c['moved_in']:>10}"
              f"{c['moved_out']:>11}{c['net']:>+7}  {why}")
    print(f"{'total':<16}{total['added']:>7}{total['deleted']:>9}{total['moved_in']:>10}"
          f"{total['moved_out']:>11}{total['net']:>+7}")


if __name__ == "__main__":
    sys.exit(main())

"""Kill -9 recovery before and after issue 29's protocol changes, in interleaved blocks.

Issue 29 asks that kill -9 recovery (bench_recovery's default: 3 nodes, one SIGKILLed, lease TTL
2 s, the restart path) stay within 10 % of before. "Before" is a tree of the base commit
(``--base``, default 999ee96: the parent of a37f6cb, issue 29's first commit, which brought the
long-lived keep-alive stream and dropped ``prev_kv``; ed665e2, the rendezvous package, came
right after it), unpacked with ``git archive`` into a temporary directory. "After" is this
checkout.

Both arms are timed by this checkout's bench/bench_recovery.py (copied into the base tree), so
one clock and one validity rule judge both: the base's own copy timed from after the kill
returned, without the detection-floor rule. Each arm runs its own tree's elasticd and
examples/train.py: ``PYTHONPATH`` names the tree (it comes before the venv's editable install
on ``sys.path``), and the daemons, agents and zygotes it starts inherit it.

Which code each process actually ran is recorded, not assumed: a ``sitecustomize`` on the path
of both arms notes, for every Python process that imports ``elasticd``, the file that import
resolves to and the process's command line. A block whose processes loaded the other arm's
code fails the bracket.

    /work/wt/cpulock timeout 900 .venv/bin/python bench/scale_recovery_bracket.py \\
        --out bench/results/scale_recovery_bracket.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.bench_recovery import detection_floor, summarize  # noqa: E402

#: Written into a directory both arms put first on PYTHONPATH. It records where ``elasticd``
#: resolves in each process that imports it (PathFinder is what the import system asks next:
#: the witness only looks, then lets the import go on).
WITNESS = '''\
import importlib.machinery
import os
import sys

_LOG = os.environ.get("SCALE_BRACKET_CODE_LOG")


class _Witness:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "elasticd":
            return None
        sys.meta_path.remove(_Witness)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        try:
            with open("/proc/self/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\\0", b" ").decode(errors="replace")[:300]
            with open(_LOG, "a") as fh:
                fh.write("%d\\t%s\\t%s\\n" % (os.getpid(), spec.origin if spec else "-", cmd))
        except OSError:
            pass
        return None


if _LOG:
    sys.meta_path.insert(0, _Witness)
'''


def _kind(cmd: str) -> str:
    for key, kind in (("elasticd.daemon.main", "daemon"), ("torch.distributed.run", "agent"),
                      ("elasticd.agent.zygote", "zygote"), ("elasticd.cli.main", "elasticctl"),
                      ("bench_recovery.py", "bench")):
        if key in cmd:
            return kind
    return "other: " + cmd[:80]


def code_seen(log: str, tree: str) -> dict:
    """Per kind of process: how many imported elasticd from ``tree`` and how many elsewhere."""
    seen: dict = {}
    with open(log) as fh:
        for line in fh:
            _pid, origin, cmd = line.rstrip("\n").split("\t", 2)
            row = seen.setdefault(_kind(cmd), {"from_tree": 0, "elsewhere": []})
            if origin.startswith(tree + os.sep):
                row["from_tree"] += 1
            else:
                row["elsewhere"].append(origin)
    return seen


def run_block(tree: str, runs: int, witness_dir: str, log: str, out: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{witness_dir}:{tree}", "SCALE_BRACKET_CODE_LOG": log}
    cmd = [sys.executable, os.path.join(tree, "bench", "bench_recovery.py"), "--runs",
           str(runs), "--baseline-runs", "0", "--out", out]
    started = time.time()
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as fh:
        detail = json.load(fh)["elasticd"]["detail"]
    return {"seconds_wall": round(time.time() - started, 1), "detail": detail,
            "code_seen": code_seen(log, tree)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="999ee96")
    p.add_argument("--blocks", default="base:5,head:5,head:5,base:5,base:5,head:5,head:5,base:5",
                   help="ARM:RUNS,... in order (ARM: base or head)")
    p.add_argument("--budget-minutes", type=float, default=13.0,
                   help="begin no block that the slowest block so far would carry past this")
    p.add_argument("--out", default="bench/results/scale_recovery_bracket.json")
    args = p.parse_args()
    blocks = [(a, int(n)) for a, n in (b.split(":") for b in args.blocks.split(","))]
    if not all(a in ("base", "head") for a, _ in blocks):
        p.error(f"--blocks {args.blocks!r}: each block is base:RUNS or head:RUNS")
    git = ["git", "-C", REPO]
    base = subprocess.run([*git, "rev-parse", args.base], check=True, capture_output=True,
                          text=True).stdout.strip()
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "elasticd", "examples"],
                           check=True, capture_output=True, text=True).stdout.strip()
    if dirty:
        raise SystemExit(f"uncommitted changes under elasticd/ or examples/: {dirty}")
    work = tempfile.mkdtemp(prefix="scale-bracket-")
    os.chmod(work, 0o755)  # the job's user reads the base tree
    try:
        base_tree = os.path.join(work, "base")
        os.makedirs(base_tree)
        archive = subprocess.run([*git, "archive", base], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", base_tree], input=archive.stdout, check=True)
        shutil.copy(os.path.join(REPO, "bench", "bench_recovery.py"),
                    os.path.join(base_tree, "bench", "bench_recovery.py"))
        witness = os.path.join(work, "witness")
        os.makedirs(witness)
        with open(os.path.join(witness, "sitecustomize.py"), "w") as fh:
            fh.write(WITNESS)
        trees = {"base": base_tree, "head": REPO}
        done, skipped, began = [], [], time.time()
        for i, (arm, runs) in enumerate(blocks):
            # A block's runs take as long as the slowest block's so far, and a fifth more.
            slowest = max((b["seconds_wall"] / b["runs"] * runs * 1.2 for b in done), default=0.0)
            if skipped or time.time() - began + slowest > args.budget_minutes * 60:
                skipped.append(f"{arm}:{runs}")
                continue
            log = os.path.join(work, f"code-{i}.log")
            with open(log, "w"):
                pass
            os.chmod(log, 0o666)  # workers may run as the job's user
            block = {"arm": arm, "runs": runs,
                     **run_block(trees[arm], runs, witness, log, os.path.join(work, f"{i}.json"))}
            foreign = {k: v["elsewhere"] for k, v in block["code_seen"].items() if v["elsewhere"]}
            if foreign or "daemon" not in block["code_seen"]:
                raise SystemExit(f"block {i} ({arm}) ran other code than its tree's: "
                                 f"{foreign or 'no daemon imported elasticd'}")
            done.append(block)
            secs = sorted(r["seconds"] for r in block["detail"] if r.get("seconds") is not None)
            print(f"block {i + 1} {arm}: {secs} ({block['seconds_wall']} s)", flush=True)
            write(args, base, head, done, skipped)  # a hold cut short keeps its blocks
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = write(args, base, head, done, skipped)
    print(json.dumps({k: result[k] for k in ("median_seconds", "ratio_head_over_base",
                                              "blocks_skipped_for_budget")}))
    return 0


def write(args, base: str, head: str, done: list, skipped: list) -> dict:
    """Writes the result of the blocks run so far to ``args.out``; returns it."""
    floor = detection_floor(2)
    arms = {}
    for arm in ("base", "head"):
        detail = [r for b in done if b["arm"] == arm for r in b["detail"]]
        arms[arm] = summarize(detail, floor)
        arms[arm]["seconds_sorted"] = sorted(
            round(r["seconds"], 3) for r in detail if r["recovered"] and not r.get("invalid"))
    med = {a: statistics.median(v["seconds_sorted"]) if v["seconds_sorted"] else None
           for a, v in arms.items()}
    result = {
        "benchmark": "recovery_kill9_node, base vs head in interleaved blocks (issue 29)",
        "command": "bench/scale_recovery_bracket.py " + " ".join(sys.argv[1:]),
        "block_command": "bench/bench_recovery.py --runs RUNS --baseline-runs 0 (this "
                         "checkout's copy in both trees; defaults: 3 nodes, kill -9, TTL 2 s)",
        "base": {"commit": base, "why": "the parent of a37f6cb, issue 29's first commit (one "
                 "keep-alive stream per client, prev_kv only where read), which ed665e2 "
                 "(the rendezvous package, protocol 2) followed; the tree before every change "
                 "of issue 29's protocol. It also lacks every other change merged since "
                 "(issues 26, 27, 28, 30, 31): the bracket compares whole trees."},
        "head": {"commit": head},
        "blocks": [{k: v for k, v in b.items() if k != "detail"} |
                   {"seconds": [r.get("seconds") for r in b["detail"]],
                    "invalid": [r["invalid"] for r in b["detail"] if r.get("invalid")]}
                   for b in done],
        "blocks_skipped_for_budget": skipped,
        "arms": arms,
        "median_seconds": med,
        "ratio_head_over_base": (round(med["head"] / med["base"], 3)
                                 if med["head"] and med["base"] else None),
        "runs_detail": {a: [r for b in done if b["arm"] == a for r in b["detail"]]
                        for a in ("base", "head")},
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    sys.exit(main())

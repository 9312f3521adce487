"""``elasticctl`` job commands: submit, jobs, stop, retry, logs.

A submitted spec is validated in full before anything is written (bad nnodes, missing script,
unknown user, unknown option: a one-line error, exit 2, nothing in etcd); spec and control are
then written in one transaction, only if no job of that name exists. Then ``submit`` waits a
few seconds (:data:`VERDICT_SECONDS`; ``--no-wait`` skips it) for the nodes' verdicts: each
node's policy decides whether it runs the job, and a job too few nodes accept ends ``submit``
with exit 1 and each refusal's reason, which names the fix.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from elasticd.cli import options
from elasticd.cli.errors import CommandFailed, confirm
from elasticd.cli.output import Table
from elasticd.cli.replicas import live_nodes
from elasticd.clock import SYSTEM_CLOCK
from elasticd.cluster import job_verdict, jobspec
from elasticd.cluster.jobspec import JobControl, JobSpec, JobState, NodeJobStatus
from elasticd.coordination import records
from elasticd.coordination.api import Compare, Coordinator, Put
from elasticd.coordination.keys import Keyspace

JOB_TABLE = Table([("JOB", "job"), ("STATE", "state"), ("NODES", "nnodes"),
                   ("PROCS", "nproc_per_node"), ("RUNNING ON", "running_on"),
                   ("HANG TIMEOUT", "hang_timeout"), ("STRAGGLERS", "stragglers"),
                   ("SCRIPT", "script"),
                   ("PROTECTION / REASON", "protection")],
                  max_width=160)
LOG_TABLE = Table([("NODE", "node"), ("STATE", "state"), ("HOST", "hostname"), ("LOG", "log")],
                  max_width=120)
#: submit's options that jobspec.build takes as they are (its keywords are their names).
SPEC_OPTIONS = ("user", "cwd", "env", "python", "max_restarts", "hang_timeout",
                "crash_loop_restarts", "hang_timeout_floor", "hang_first_step",
                "straggler_factor", "straggler_steps", "straggler_drain", "in_process",
                "reform_deadline")
#: How long ``submit`` waits for every live node's verdict (a daemon answers within a cycle
#: or two of its main loop, and checks the job's files as its user).
VERDICT_SECONDS = 5.0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "submit", parents=[common], help="submit a training job",
        description="Store a job spec in etcd; every daemon runs a torchrun agent for it.",
        epilog="Example: elasticctl submit mnist --nnodes 2:3 --nproc-per-node 1 "
               "--user train -- /opt/jobs/train.py --epochs 3")
    s.add_argument("name")
    s.add_argument("--nnodes", required=True, help="N or MIN:MAX nodes")
    s.add_argument("--nproc-per-node", type=int, required=True)
    s.add_argument("--max-restarts", type=int, default=100,
                   help="torchrun --max-restarts (worker group restarts per agent)")
    s.add_argument("--user", help="run as this user (required when submitting as root)")
    s.add_argument("--cwd", help="workers' working directory (default: the current one)")
    s.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    s.add_argument("--python", help="interpreter with torch (default: this one)")
    s.add_argument("--hang-timeout", type=options.finite("seconds"), default=None,
                   metavar="SECONDS",
                   help="seconds without progress before workers restart (0: off; default: "
                        "learned from the job's step times: 5x the longest of the last 1000 "
                        "steps, at least --hang-timeout-floor)")
    s.add_argument("--hang-timeout-floor", type=options.seconds(0, 86400, 60.0, low_open=True),
                   default=60.0, metavar="SECONDS",
                   help="the lowest learned hang timeout (default 60)")
    s.add_argument("--hang-first-step", type=options.seconds(0, 86400, 600.0, low_open=True),
                   default=600.0, metavar="SECONDS",
                   help="learned hang timeout: the allowance for each worker's first steps "
                        "after a (re)start: compile, data loader warm-up (default 600)")
    s.add_argument("--crash-loop-restarts", type=int, default=5, metavar="N",
                   help="stop the job as failed after N worker group restarts in a row with "
                        "no new committed step (0: never)")
    s.add_argument("--straggler-factor", type=options.finite("times"), default=1.5,
                   metavar="X",
                   help="name a node a straggler when its compute time per step stays above X "
                        "times the other nodes' median (the script reports it: ComputeTimer; "
                        "0: off; default 1.5)")
    s.add_argument("--straggler-steps", type=options.whole(1, 100_000), default=20, metavar="N",
                   help="steps in a row to name (and to clear) a straggler (default 20)")
    s.add_argument("--straggler-drain", action="store_true",
                   help="drain a node named a straggler so the job goes on without it (only "
                        "while the job keeps its minimum of nodes)")
    s.add_argument("--in-process", action="store_true",
                   help="keep survivors' worker processes through a failure: they re-form "
                        "in-process (the script uses @elasticd.in_process; a node that cannot "
                        "re-form in time restarts its workers as today)")
    s.add_argument("--reform-deadline",
                   type=options.seconds(0, jobspec.MAX_REFORM_DEADLINE,
                                        jobspec.DEFAULT_REFORM_DEADLINE, low_open=True),
                   default=jobspec.DEFAULT_REFORM_DEADLINE, metavar="SECONDS",
                   help="with --in-process: seconds after a new round closes within which "
                        "every local worker must leave the old group, else its node "
                        "restarts its workers as today (default "
                        f"{jobspec.DEFAULT_REFORM_DEADLINE:g})")
    s.add_argument("--no-wait", action="store_true",
                   help=f"return once the job is stored, without waiting (up to "
                        f"{VERDICT_SECONDS:g} s) for the nodes to accept or refuse it")
    s.add_argument("script", help="training script, after --")
    s.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("jobs", parents=[common], help="jobs and where they run",
                   description="Every job, its desired state, and each node's view of it.",
                   epilog="Example: elasticctl jobs --watch 2")
    st = sub.add_parser("stop", parents=[common], help="stop a job everywhere",
                        description="Mark a job stopped; every daemon stops its processes.",
                        epilog="Examples:\n  elasticctl stop mnist --force --wait 60\n"
                               "Without --force it asks on a terminal and refuses in a "
                               "script (exit 2).",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("name")
    st.add_argument("--force", action="store_true", help="do not ask")
    st.add_argument("--wait", type=options.seconds(0, 86400, 0), default=0, metavar="SECONDS",
                    help="wait until no node runs it")
    rt = sub.add_parser("retry", parents=[common], help="check a refused job again everywhere",
                        description="Rewrite a running job's control so that every node that "
                        "refused it (its files failed a check, or the check hung) checks it "
                        "again.")
    rt.add_argument("name")
    lg = sub.add_parser("logs", parents=[common], help="where a job's worker logs are",
                        description="Per node: the file holding the agent's and workers' output.",
                        epilog="Example: elasticctl logs mnist --format json")
    lg.add_argument("name")


def _node_statuses(coord: Coordinator, keys: Keyspace, job: str) -> list[NodeJobStatus]:
    kvs, _ = coord.get_prefix(keys.job_keys(job).nodes)
    out = []
    for kv in kvs:
        node = kv.key[len(keys.job_keys(job).nodes):].decode(errors="replace")
        with contextlib.suppress(records.RecordError):
            out.append(NodeJobStatus.decode(kv.value, kv.key, node))
    return out


def cmd_submit(args: argparse.Namespace, coord: Coordinator, keys: Keyspace) -> Any:
    args_list = args.args[1:] if args.args[:1] == ["--"] else list(args.args)
    spec = jobspec.build(args.name, args.nnodes, args.nproc_per_node, args.script, args_list,
                         **{option: getattr(args, option) for option in SPEC_OPTIONS})
    control = JobControl(JobState.RUNNING, SYSTEM_CLOCK.wall(), "elasticctl")
    ok, _ = coord.transaction(
        [Compare(keys.job_keys(spec.name).spec, 0)],
        [Put(keys.job_keys(spec.name).spec, spec.encode()),
         Put(keys.job_keys(spec.name).control, control.encode())])
    if not ok:
        raise CommandFailed(f"job {spec.name!r} already exists: stop it, or pick another name")
    doc = {"job": spec.name, "submitted": True, "nnodes": spec.torchrun_nnodes(),
           "nproc_per_node": spec.nproc_per_node, "script": spec.script,
           "script_sha256": spec.script_sha256, "user": spec.user}
    if args.no_wait:
        return {**doc, "state": None, "detail": "not waited for (--no-wait)", "refused": {}}
    verdict = _await_verdict(coord, keys, spec)
    if verdict.state in (job_verdict.REFUSED, job_verdict.FAILED):
        raise CommandFailed(
            f"job {spec.name!r} will not run: {verdict.why}. Fix that and submit it again "
            f"under another name ({spec.name!r} stays listed as {verdict.state} in "
            "`elasticctl jobs`)")
    return {**doc, "state": verdict.state, "detail": verdict.why,
            "refused": dict(verdict.refused)}


def _await_verdict(coord: Coordinator, keys: Keyspace, spec: JobSpec) -> job_verdict.JobVerdict:
    """The job's verdict once every live node has answered, the job runs or it cannot; or
    as it stands after :data:`VERDICT_SECONDS`."""
    deadline = SYSTEM_CLOCK.monotonic() + VERDICT_SECONDS
    while True:
        raw = coord.get(keys.job_keys(spec.name).control)
        control = None
        with contextlib.suppress(records.RecordError):
            control = JobControl.decode(raw.value, raw.key) if raw is not None else None
        verdict = job_verdict.judge(spec.nnodes_min, control,
                                    _node_statuses(coord, keys, spec.name),
                                    live_nodes(coord, keys))
        if verdict.settled or SYSTEM_CLOCK.monotonic() >= deadline:
            return verdict
        SYSTEM_CLOCK.sleep(0.2)


def cmd_jobs(args: argparse.Namespace, coord: Coordinator, keys: Keyspace) -> Any:
    kvs, _ = coord.get_prefix(keys.jobs)
    specs: dict[str, JobSpec] = {}
    controls: dict[str, JobControl] = {}
    bad: dict[str, str] = {}  # job -> why its spec does not read (every daemon refuses it)
    for kv in kvs:
        try:
            job, what, rest = keys.job_key(kv.key)
        except ValueError:
            continue  # no valid job name: no daemon takes it for a job either
        try:
            if what == "spec" and not rest:
                specs[job] = JobSpec.decode(kv.value, kv.key, job)
            elif what == "control" and not rest:
                controls[job] = JobControl.decode(kv.value, kv.key)
        except records.RecordError as exc:
            if what == "spec":
                bad[job] = f"unreadable job spec: {exc}"
    live = live_nodes(coord, keys)
    out = []
    for name, why in sorted(bad.items()):
        nodes = {st.node: st.as_dict() for st in _node_statuses(coord, keys, name)}
        out.append({
            "job": name,
            "desired": controls[name].desired if name in controls else JobState.RUNNING,
            "nnodes": "-", "nproc_per_node": "-", "script": "", "args": [], "user": "",
            "submitted_at": 0.0, "running_on": f"refused: {why}", "refused": why,
            "state": job_verdict.REFUSED, "state_detail": why,
            "reason": why, "protection": "-", "hang_timeout": "-", "stragglers": "-",
            "nodes": nodes,
        })
    for name, spec in sorted(specs.items(), key=lambda kv: kv[1].created_at):
        statuses = _node_statuses(coord, keys, name)
        nodes = {st.node: st.as_dict() for st in statuses}
        running = sorted(n for n, st in nodes.items() if st["state"] == JobState.RUNNING)
        control = controls.get(name)
        verdict = job_verdict.judge(spec.nnodes_min, control, statuses, live)
        refused = sorted(n for n, st in nodes.items() if st["state"] == JobState.REFUSED)
        waiting = sorted(n for n, st in nodes.items() if st["state"] == JobState.IDLE
                         and st["detail"].startswith("waiting: "))
        where = ",".join(running) or "-"
        if not running and refused:  # each node's policy decides: say why, once
            where = f"refused on {','.join(refused)}: {nodes[refused[0]]['detail']}"
        elif not running and waiting:  # its files are not on those nodes yet
            where = (f"waiting on {','.join(waiting)}: "
                     f"{nodes[waiting[0]]['detail'].removeprefix('waiting: ')}")
        out.append({
            "job": name, "desired": control.desired if control else JobState.RUNNING,
            "state": verdict.state, "state_detail": verdict.why,
            "reason": control.reason if control else "",
            "protection": _protection(nodes, control) if verdict.state in (
                job_verdict.RUNNING, job_verdict.FAILED) else "-",
            "nnodes": spec.torchrun_nnodes(), "nproc_per_node": spec.nproc_per_node,
            "script": spec.script, "args": spec.args, "user": spec.user,
            "submitted_at": spec.created_at, "running_on": where, "nodes": nodes,
            "hang_timeout": _hang_timeout(spec, [nodes[n] for n in running]),
            "stragglers": _stragglers(nodes),
        })
    return out


def _hang_timeout(spec: JobSpec, running: list[dict[str, Any]]) -> str:
    """One cell: the hang timeout in force where the job runs (``learned 75 s``, ``set 300
    s``, ``floor 60 s``; a range when nodes differ), else what the spec asks for."""
    if spec.hang_timeout == 0:
        return "off"
    shown = [(st["hang_timeout_source"], st["hang_timeout"]) for st in running
             if st.get("hang_timeout") and st.get("hang_timeout_source")]
    if not shown:
        return "learned" if spec.hang_timeout is None else f"set {spec.hang_timeout:g} s"
    sources = sorted({src for src, _ in shown})
    lo, hi = min(v for _, v in shown), max(v for _, v in shown)
    return f"{'/'.join(sources)} {lo:g} s" if lo == hi else \
        f"{'/'.join(sources)} {lo:g}-{hi:g} s"


def _stragglers(nodes: dict[str, dict[str, Any]]) -> str:
    """One cell: the nodes that name themselves stragglers, with why, or "-"."""
    named = [f"{n} ({st['straggler'].removeprefix('STRAGGLER: ')})"
             for n, st in sorted(nodes.items()) if st.get("straggler")]
    return "; ".join(named) or "-"


def _protection(nodes: dict[str, dict[str, Any]], control: JobControl | None) -> str:
    """One cell: why the job failed, the nodes where it is unprotected and why, or "ok"."""
    if control is not None and control.desired == JobState.FAILED:
        return control.reason or "failed"
    bad = [f"{n}: {st['unprotected'].removeprefix('UNPROTECTED: ')}"
           for n, st in sorted(nodes.items()) if st.get("unprotected")]
    return "UNPROTECTED: " + "; ".join(bad) if bad else "ok"


def _must_exist(coord: Coordinator, keys: Keyspace, job: str) -> None:
    if coord.get(keys.job_keys(job).spec) is None:
        raise CommandFailed(f"no job named {job!r} (see: elasticctl jobs)")


def cmd_stop(args: argparse.Namespace, coord: Coordinator, keys: Keyspace) -> Any:
    _must_exist(coord, keys, args.name)
    confirm(f"stop job {args.name} on every node?",
            f"stopping {args.name!r} ends its training everywhere", args.force)
    coord.put(keys.job_keys(args.name).control,
              JobControl(JobState.STOPPED, SYSTEM_CLOCK.wall(), "elasticctl").encode())
    deadline = SYSTEM_CLOCK.monotonic() + args.wait
    while True:
        running = [s.node for s in _node_statuses(coord, keys, args.name)
                   if s.state in (JobState.STARTING, JobState.RUNNING, JobState.RESTARTING,
                                 JobState.STOPPING)]
        if not running or SYSTEM_CLOCK.monotonic() >= deadline:
            break
        SYSTEM_CLOCK.sleep(0.2)
    if running and args.wait:
        raise CommandFailed(f"{args.name}: still running on {', '.join(running)} after "
                            f"{args.wait:g} s")
    return {"job": args.name, "desired": JobState.STOPPED, "still_running_on": running}


def cmd_retry(args: argparse.Namespace, coord: Coordinator, keys: Keyspace) -> Any:
    _must_exist(coord, keys, args.name)
    kv = coord.get(keys.job_keys(args.name).control)
    try:
        control = JobControl.decode(kv.value, kv.key) if kv is not None else None
    except records.RecordError:
        control = None  # unreadable: writing a good one is the retry
    if control is not None and control.desired != JobState.RUNNING:
        raise CommandFailed(f"job {args.name!r} is {control.desired}: retry checks a running "
                            "job again on the nodes that refused it")
    coord.put(keys.job_keys(args.name).control,
              JobControl(JobState.RUNNING, SYSTEM_CLOCK.wall(), "elasticctl retry").encode())
    refused = [s.node for s in _node_statuses(coord, keys, args.name)
               if s.state == JobState.REFUSED]
    return {"job": args.name, "retried": True, "refused_on": refused}


def cmd_logs(args: argparse.Namespace, coord: Coordinator, keys: Keyspace) -> Any:
    _must_exist(coord, keys, args.name)
    nodes = live_nodes(coord, keys)
    return [{"node": s.node, "state": s.state,
             "hostname": nodes.get(s.node, {}).get("hostname", "?"), "log": s.log}
            for s in _node_statuses(coord, keys, args.name)]


def _submit_pretty(doc: dict[str, Any]) -> str:
    text = (f"submitted job {doc['job']}: {doc['nnodes']} nodes x {doc['nproc_per_node']} "
            f"workers, {doc['script']} as {doc['user']}\n"
            + (f"{doc['state']}: {doc['detail']}" if doc["state"] else
               "the nodes' verdicts not waited for (--no-wait): see elasticctl jobs"))
    if doc["refused"] and doc["state"] == job_verdict.RUNNING:  # refused on some nodes only
        text += f"\nrefused on {job_verdict.refusals(doc['refused'])}"
    return text


def _retry_pretty(doc: dict[str, Any]) -> str:
    where = ", ".join(doc["refused_on"]) or "no node"
    return f"job {doc['job']}: checked again everywhere (it was refused on {where})"


def _stop_pretty(doc: dict[str, Any]) -> str:
    left = doc["still_running_on"]
    return f"job {doc['job']} stopped" + (f" (still stopping on {', '.join(left)})" if left else "")


COMMANDS = {
    "submit": (cmd_submit, _submit_pretty),
    "jobs": (cmd_jobs, JOB_TABLE),
    "stop": (cmd_stop, _stop_pretty),
    "retry": (cmd_retry, _retry_pretty),
    "logs": (cmd_logs, LOG_TABLE),
}

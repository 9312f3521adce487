"""A job as a whole, from its control and each node's status: what ``elasticctl`` shows.

Each node decides for itself whether it runs a job (its policy, :mod:`elasticd.cluster.job_policy`)
and says so in its status under ``jobs/<job>/nodes/<node>``. A job every node refused, or one
too few nodes accept to reach its minimum, will never start; a job one node finished is over
(torch closes the rendezvous when an agent succeeds). This module reads those statuses, with
the job's control and the live nodes, into one state and one line (pure: no etcd, no clock).

States: ``running`` (some node runs it), ``waiting`` (not every live node has answered yet, or
the job waits for nodes), ``refused`` (the nodes that have not refused it are fewer than its
minimum), ``succeeded``, ``failed`` (stopped as failed: a crash loop), ``stopping`` and
``stopped`` (stopped by ``elasticctl stop``). A node whose agent died too often gave up on
the job: counted as one that refused it, and the job is ``failed`` when too few nodes are left.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from elasticd.cluster.jobspec import JobControl, JobState, NodeJobStatus

#: A node's states that mean its agent is (or is about to be) up.
ACTIVE = (JobState.STARTING, JobState.RUNNING, JobState.RESTARTING)

RUNNING, WAITING, REFUSED = "running", "waiting", "refused"
SUCCEEDED, FAILED, STOPPING, STOPPED = "succeeded", "failed", "stopping", "stopped"


@dataclasses.dataclass(frozen=True)
class JobVerdict:
    """The job as a whole.

    Attributes:
        why: one line saying why, with what to do for a refusal.
        running: nodes whose agent is up.
        refused: node -> its reason (the node's own line, which names the fix).
        pending: live nodes that have said nothing of the job yet.
    """

    state: str
    why: str
    running: tuple[str, ...] = ()
    refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    pending: tuple[str, ...] = ()

    @property
    def settled(self) -> bool:
        """True when waiting longer would tell a submitter nothing new: every live node has
        answered, or the job is over or cannot run whatever the others say."""
        return not self.pending or self.state not in (RUNNING, WAITING)


def refusals(refused: Mapping[str, str]) -> str:
    """``n1, n2: <reason>; n3: <other reason>`` — nodes grouped by their reason."""
    by_reason: dict[str, list[str]] = {}
    for node, reason in sorted(refused.items()):
        by_reason.setdefault(reason, []).append(node)
    return "; ".join(f"{', '.join(nodes)}: {reason}" for reason, nodes in by_reason.items())


def judge(min_nodes: int, control: JobControl | None, statuses: Iterable[NodeJobStatus],
          live: Iterable[str]) -> JobVerdict:
    """The job's state from its control, its nodes' statuses and the live nodes.

    Args:
        min_nodes: the job's minimum of nodes (``--nnodes MIN:MAX``).
        control: the job's control record (None: running, as ``submit`` writes it).
        statuses: every node's status of this job (those of dead nodes are gone with their
            leases).
        live: the nodes alive now (their records exist).
    """
    by_node = {st.node: st for st in statuses}
    running = tuple(sorted(n for n, st in by_node.items() if st.state in ACTIVE))
    refused = {n: st.detail or "refused" for n, st in sorted(by_node.items())
               if st.state == JobState.REFUSED}
    pending = tuple(sorted(set(live) - set(by_node)))
    done = sorted(n for n, st in by_node.items() if st.state == JobState.SUCCEEDED)
    common = dict(running=running, refused=refused, pending=pending)
    if control is not None and control.desired == JobState.FAILED:
        return JobVerdict(FAILED, control.reason or "failed", **common)
    if control is not None and control.desired == JobState.STOPPED:
        if running:
            return JobVerdict(STOPPING, f"stopping on {', '.join(running)}", **common)
        return JobVerdict(STOPPED, f"stopped by {control.by or 'elasticctl'}", **common)
    if done:
        return JobVerdict(SUCCEEDED, f"finished: succeeded on {', '.join(done)}", **common)
    if running:
        return JobVerdict(RUNNING, f"running on {', '.join(running)}", **common)
    # A node whose agent died too often gave up on the job (FAILED) as one that refused it.
    gave_up = {n: st.detail or "failed" for n, st in sorted(by_node.items())
               if st.state == JobState.FAILED}
    able = set(live) - set(refused) - set(gave_up)
    if (refused or gave_up) and len(able) < min_nodes:
        left = (f"the {len(able)} other node{'s' if len(able) != 1 else ''} cannot run it "
                f"alone (it needs {min_nodes})" if able else "no node will run it")
        said = "; ".join([f"failed on {refusals(gave_up)}"] * bool(gave_up)
                         + [f"refused on {refusals(refused)}"] * bool(refused))
        return JobVerdict(FAILED if gave_up else REFUSED, f"{said}; {left}", **common)
    if pending:
        return JobVerdict(WAITING, f"no answer yet from {', '.join(pending)}", **common)
    # A node whose copy of the job's files is not there yet (not deployed) checks again soon.
    files = {n: st.detail.removeprefix("waiting: ") for n, st in sorted(by_node.items())
             if st.state == JobState.IDLE and st.detail.startswith("waiting: ")}
    if files:
        return JobVerdict(WAITING, f"waiting on {refusals(files)}", **common)
    return JobVerdict(WAITING, f"waiting for nodes (it needs {min_nodes})", **common)

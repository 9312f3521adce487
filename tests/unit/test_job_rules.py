"""A job's decisions on a node alone (elasticd/agent/job_rules.py): no manager, no etcd.

Each rule has a test of its own; which job runs is also checked against its definition over
any set of job records (hypothesis).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.agent import job_rules
from elasticd.agent.job_rules import AgentExit, JobBook, JobView, PeerFailure, Start, Stop
from elasticd.cluster.jobspec import DEFAULT_REFORM_DEADLINE, JobState, NodeJobStatus


def view(created=None, desired=None, reasons=None, unreadable=None, finished=(),
         elsewhere=()):
    return JobView(created or {}, desired or {}, reasons or {}, unreadable or {},
                   frozenset(finished), frozenset(elsewhere))


never = lambda job: False  # noqa: E731


# -- which job runs ----------------------------------------------------------------------------

def test_the_oldest_wanted_job_runs():
    v = view(created={"b": 7, "a": 9, "c": 3}, desired={"c": JobState.STOPPED})
    assert job_rules.wanted(v, None, "", never) == "b"


def test_a_held_node_runs_nothing():
    assert job_rules.wanted(view(created={"a": 1}), None, "drained", never) is None


def test_a_finished_job_is_not_wanted_again():
    assert job_rules.wanted(view(created={"a": 1, "b": 2}, finished={"a"}), None, "",
                            never) == "b"


def test_a_job_that_succeeded_elsewhere_starts_nowhere_new_but_keeps_its_running_agent():
    v = view(created={"a": 1, "b": 2}, elsewhere={"a"})
    assert job_rules.wanted(v, None, "", never) == "b"
    assert job_rules.wanted(v, "a", "", never) == "a"  # its agent ends on its own


def test_a_refused_or_waiting_job_is_passed_over_unless_it_runs():
    v = view(created={"a": 1, "b": 2})
    assert job_rules.wanted(v, None, "", lambda job: job == "a") == "b"
    assert job_rules.wanted(v, "a", "", lambda job: job == "a") == "a"


def test_an_unreadable_spec_is_wanted_to_be_refused():
    assert job_rules.wanted(view(created={"a": 1}, unreadable={"a": "bad"}), None, "",
                            never) == "a"


@settings(max_examples=200, deadline=None)
@given(jobs=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 5), max_size=6),
       stopped=st.sets(st.sampled_from("abcdef")), finished=st.sets(st.sampled_from("abcdef")),
       elsewhere=st.sets(st.sampled_from("abcdef")), held=st.sets(st.sampled_from("abcdef")),
       running=st.none() | st.sampled_from("abcdef"), hold=st.sampled_from(["", "drained"]))
def test_the_job_chosen_is_the_first_eligible_one(jobs, stopped, finished, elsewhere, held,
                                                   running, hold):
    v = view(created=jobs, desired={j: JobState.STOPPED for j in stopped}, finished=finished,
             elsewhere=elsewhere)
    chosen = job_rules.wanted(v, running, hold, held.__contains__)

    def eligible(j):
        return (j not in stopped and j not in finished
                and (j == running or (j not in elsewhere and j not in held)))

    order = sorted(jobs, key=lambda j: (jobs[j], j))
    expected = None if hold else next((j for j in order if eligible(j)), None)
    assert chosen == expected


# -- when a running job stops --------------------------------------------------------------------

def test_a_running_job_whose_spec_became_unreadable_is_refused():
    v = view(created={"a": 1}, unreadable={"a": "unreadable job spec: x"})
    assert job_rules.stop_running(v, "a", "a", "") == Stop("unreadable job spec: x",
                                                           JobState.REFUSED)


def test_a_running_job_still_wanted_goes_on():
    assert job_rules.stop_running(view(created={"a": 1}), "a", "a", "") is None


def test_a_running_job_stops_drained_failed_or_stopped():
    v = view(created={"a": 1}, desired={"a": JobState.FAILED}, reasons={"a": "crash loop"})
    assert job_rules.stop_running(v, "a", None, "drained") == Stop("node drained",
                                                                   JobState.DRAINED)
    assert job_rules.stop_running(v, "a", None, "") == Stop("crash loop", JobState.FAILED)
    v = view(created={"a": 1}, desired={"a": JobState.FAILED})
    assert job_rules.stop_running(v, "a", None, "") == Stop("job a failed", JobState.FAILED)
    v = view(created={"a": 1}, desired={"a": JobState.STOPPED})
    assert job_rules.stop_running(v, "a", None, "") == Stop("job a is no longer wanted here",
                                                            JobState.STOPPED)


def test_a_job_waiting_to_restart_ends_when_decided_elsewhere():
    v = view(created={"a": 1}, elsewhere={"a"})
    assert job_rules.decided_elsewhere(v, "a") == (JobState.SUCCEEDED, "")
    v = view(created={"a": 1}, desired={"a": JobState.FAILED}, reasons={"a": "loop"})
    assert job_rules.decided_elsewhere(v, "a") == (JobState.FAILED, "loop")
    assert job_rules.decided_elsewhere(view(created={"a": 1}), "a") is None
    assert job_rules.decided_elsewhere(view(created={"a": 1}, elsewhere={"a"},
                                            finished={"a"}), "a") is None


# -- a dead agent ------------------------------------------------------------------------------------

def test_a_dead_agent_is_restarted_with_backoff_until_its_budget_is_spent():
    assert job_rules.agent_exited(0, False, 0, 10) is AgentExit.SUCCEEDED
    assert job_rules.agent_exited(1, True, 1, 10) is AgentExit.SUCCEEDED_ELSEWHERE
    assert job_rules.agent_exited(1, False, 10, 10) is AgentExit.RESTART
    assert job_rules.agent_exited(1, False, 11, 10) is AgentExit.GIVE_UP
    assert [job_rules.restart_backoff(n) for n in (1, 2, 3, 7, 20)] == [0.5, 1.0, 2.0, 30.0,
                                                                         30.0]


# -- a failed peer -----------------------------------------------------------------------------------

def test_a_failed_peer_that_ran_the_job_restarts_the_workers():
    asked = []

    def reformed():
        asked.append(1)
        return False

    assert job_rules.peer_failed(True, "n2", {"n1", "n2"}, reformed) is PeerFailure.RESTART
    assert asked == [1]
    assert job_rules.peer_failed(True, "*", set(), reformed) is PeerFailure.RESTART
    assert asked == [1]  # every peer: no round can have gone on without them all


def test_a_failed_peer_that_did_not_run_the_job_changes_nothing():
    assert job_rules.peer_failed(True, "n3", {"n1", "n2"}, lambda: True) is PeerFailure.NOT_OURS
    assert job_rules.peer_failed(False, "n2", {"n1", "n2"}, lambda: True) is PeerFailure.NOT_OURS


def test_a_group_that_already_reformed_without_the_peer_is_left_running():
    assert job_rules.peer_failed(True, "n2", {"n2"}, lambda: True) is PeerFailure.LEFT_RUNNING
    assert job_rules.reformed_without([10, 11], mine=10, theirs=12)
    assert not job_rules.reformed_without([10, 12], mine=10, theirs=12)  # the peer is in it
    assert not job_rules.reformed_without([11, 13], mine=10, theirs=12)  # we are not
    assert not job_rules.reformed_without(None, mine=10, theirs=12)  # no round
    assert not job_rules.reformed_without([10], mine=None, theirs=12)  # unknown pids
    assert not job_rules.reformed_without([10], mine=10, theirs=None)


def test_the_budget_counts_deaths_and_a_restart_waits_its_backoff():
    book = JobBook(deaths=2)
    assert book.agent_exited(1, False, agent_restarts=10, now=100.0) is AgentExit.RESTART
    assert book.not_before == 101.0  # the second death's backoff
    book.deaths = 11
    assert book.agent_exited(1, False, agent_restarts=10, now=200.0) is AgentExit.GIVE_UP
    assert book.not_before == 101.0  # no restart: no new backoff


def test_the_budget_is_one_jobs_and_a_restart_that_committed_renews_it():
    """deaths counted every agent death since the daemon started, whatever the job: a job
    began with its predecessors' deaths spent and their backoff to wait, and a weeks-long job
    was given up on its eleventh death, however much it trained in between."""
    book = JobBook()
    for n in (1, 2, 3):
        assert book.agent_died("a", None) == n
        assert book.agent_exited(1, False, agent_restarts=3, now=10.0) is AgentExit.RESTART
    assert book.not_before_for("a") == 10.0 + job_rules.restart_backoff(3)
    assert book.not_before_for("b") == 0.0  # a's backoff is not b's
    assert book.agent_died("b", (1, 5)) == 1  # a's deaths are not b's
    assert book.agent_died("b", (1, 5)) == 2  # no progress since: it counts
    assert book.agent_died("b", None) == 3  # nothing known: no progress seen
    assert book.agent_died("b", (2, 1)) == 1  # a newer commit: the restart worked
    for step in range(2, 30):  # dies once per new commit, for ever: never given up
        assert book.agent_died("b", (2, step)) == 1
        assert book.agent_exited(1, False, agent_restarts=3, now=100.0 + step) is (
            AgentExit.RESTART)
        assert book.not_before == 100.0 + step + job_rules.restart_backoff(1)
    for _ in range(3):  # ...but deaths in a row without one are
        book.agent_died("b", (2, 29))
    assert book.deaths == 4
    assert book.agent_exited(1, False, agent_restarts=3, now=200.0) is AgentExit.GIVE_UP
    assert book.agent_died("a", (9, 9)) == 1  # a again: counted afresh


# -- a start -----------------------------------------------------------------------------------

def test_a_start_waits_its_backoff_then_refuses_an_unreadable_spec_before_any_check():
    checked = []

    def check():
        checked.append(1)
        return "", False

    assert job_rules.start(5.0, 6.0, None, check) == (Start.LATER, "")
    assert job_rules.start(6.0, 6.0, "unreadable job spec: x", check) == (
        Start.REFUSE, "unreadable job spec: x")
    assert checked == []  # neither asks for a check (it may start one)
    assert job_rules.start(6.0, 6.0, None, check) == (Start.GO, "")
    assert checked == [1]


def test_a_start_follows_the_file_check():
    assert job_rules.start(0, 0, None, lambda: None) == (Start.CHECKING, "")
    assert job_rules.start(0, 0, None, lambda: ("not there", True)) == (Start.WAIT, "not there")
    assert job_rules.start(0, 0, None, lambda: ("differs", False)) == (Start.REFUSE, "differs")


def test_a_waiting_job_stays_waited_for_only_while_it_is_wanted_here():
    v = view(created={"a": 1, "b": 2, "c": 3}, desired={"b": JobState.STOPPED},
             unreadable={"c": "bad"})
    assert job_rules.still_waited(v, "a", "")
    assert not job_rules.still_waited(v, "a", "drained")
    assert not job_rules.still_waited(v, "b", "")  # stopped
    assert not job_rules.still_waited(v, "c", "")  # its spec does not read
    assert not job_rules.still_waited(v, "d", "")  # deleted


# -- stragglers and the worker group -----------------------------------------------------------

def test_a_straggler_drains_only_when_asked_and_not_below_the_jobs_minimum():
    assert job_rules.drain_straggler(True, others_running=2, nnodes_min=2)
    assert not job_rules.drain_straggler(True, others_running=1, nnodes_min=2)
    assert not job_rules.drain_straggler(False, others_running=5, nnodes_min=2)


def _st(node, state="running", ranks=(), world=0, step=-1):
    return NodeJobStatus(node, state, ranks=list(ranks), world_size=world, last_step=step)


def test_the_groups_ranks_are_known_once_every_node_published_them():
    sts = {"n1": _st("n1", ranks=[0, 1], world=4), "n2": _st("n2", ranks=[2], world=4)}
    assert job_rules.round_ranks(sts, 4) == {}  # rank 3 missing
    sts["n3"] = _st("n3", ranks=[3], world=4)
    assert job_rules.round_ranks(sts, 4) == {"n1": [0, 1], "n2": [2], "n3": [3]}
    sts["n4"] = _st("n4", ranks=[3], world=2)  # an older world: not of this group
    sts["n5"] = _st("n5", "stopping", ranks=[0], world=4)
    assert job_rules.round_ranks(sts, 4) == {"n1": [0, 1], "n2": [2], "n3": [3]}
    assert job_rules.round_ranks(sts, 0) == {}


def test_the_recovery_writer_is_the_lowest_live_survivor_that_ran_workers_else_a_spare():
    sts = {"n1": _st("n1", step=40), "n2": _st("n2", ranks=[1]), "n0": _st("n0"),
           "n9": _st("n9", ranks=[0])}
    assert job_rules.ran_workers(sts["n1"]) and not job_rules.ran_workers(sts["n0"])
    live = {"n0", "n1", "n2"}  # n9's entry is no member's: gone
    assert job_rules.recovery_writer(sts, live, failed="n2") == "n1"
    assert job_rules.recovery_writer(sts, live, failed="n1") == "n2"
    assert job_rules.recovery_writer({"n0": sts["n0"], "n2": sts["n2"]}, live, "n2") == "n0"
    assert job_rules.recovery_writer({"n2": sts["n2"]}, live, "n2") is None


@settings(max_examples=200, deadline=None)
@given(events=st.lists(st.tuples(st.integers(-9, 3), st.booleans(), st.floats(0, 100)),
                       max_size=30),
       budget=st.integers(0, 6))
def test_over_any_order_of_agent_exits_the_budget_and_backoff_hold(events, budget):
    """Any sequence of agent exits (code, succeeded elsewhere, seconds since the last): the
    job is given up exactly when its deaths pass the budget, never restarted before its
    backoff, whose wait only grows and stays under MAX_BACKOFF."""
    book, now, last_wait = JobBook(), 0.0, 0.0
    for code, elsewhere, gap in events:
        now = max(now + gap, book.not_before)  # nothing starts before the backoff ends
        if code != 0 and not elsewhere:
            book.deaths += 1
        verdict = book.agent_exited(code, elsewhere, budget, now)
        if code == 0:
            assert verdict is AgentExit.SUCCEEDED
        elif elsewhere:
            assert verdict is AgentExit.SUCCEEDED_ELSEWHERE
        elif book.deaths > budget:
            assert verdict is AgentExit.GIVE_UP
            break
        else:
            assert verdict is AgentExit.RESTART
            wait = book.not_before - now
            assert last_wait <= wait <= job_rules.MAX_BACKOFF and wait > 0
            last_wait = wait
        if verdict is not AgentExit.RESTART:
            break  # the job is over on this node


# -- in-process re-formation (issue 31) ----------------------------------------------------------

def test_an_in_process_job_re_forms_on_a_peers_failure_instead_of_a_kill():
    reformed = lambda: False  # noqa: E731
    assert job_rules.peer_failed(True, "n2", {"n1", "n2"}, reformed, in_process=True) \
        is PeerFailure.REFORM
    assert job_rules.peer_failed(True, "n2", {"n1", "n2"}, reformed) is PeerFailure.RESTART
    # Every peer at once, a peer not in the job, a round that went on: as without the mode.
    assert job_rules.peer_failed(True, "*", set(), reformed, True) is PeerFailure.RESTART
    assert job_rules.peer_failed(True, "n3", {"n1"}, reformed, True) is PeerFailure.NOT_OURS
    assert job_rules.peer_failed(True, "n2", {"n2"}, lambda: True, True) \
        is PeerFailure.LEFT_RUNNING


def test_workers_re_form_only_when_every_one_is_alive_and_linked():
    assert job_rules.can_reform(2, True, {0, 1}) == ""
    assert "not running" in job_rules.can_reform(2, False, {0, 1})
    assert "local ranks [1] are not linked" in job_rules.can_reform(2, True, {0})


def test_a_re_formation_assigns_once_all_left_waits_then_falls_back_at_the_deadline():
    step = job_rules.reform_step
    Reform = job_rules.Reform
    both = {0: (4, True, ""), 1: (4, True, "")}
    assert step(2, 4, both, True, 100.0, 110.0) == (Reform.ASSIGN, "")
    # A note from an older round is not a leave of this one.
    older = {0: (4, True, ""), 1: (3, True, "")}
    assert step(2, 4, older, True, 109.9, 110.0) == (Reform.WAIT, "")
    verdict, why = step(2, 4, older, True, 110.0, 110.0)
    assert verdict is Reform.RESTART and "local ranks [1] did not leave round 4" in why
    verdict, why = step(2, 4, {0: (4, False, "held")}, True, 100.0, 110.0)
    assert verdict is Reform.RESTART and "local rank 0 could not leave: held" in why
    assert step(2, 4, both, False, 100.0, 110.0)[0] is Reform.RESTART  # a worker died


def test_the_daemons_deadline_holds_from_the_first_failure_and_ends_when_the_agent_is_done():
    book = JobBook()
    assert not book.reform_overdue(1e9)
    book.reform_started(100.0)
    by = 100.0 + DEFAULT_REFORM_DEADLINE + job_rules.REFORM_ROUND_ALLOWANCE
    book.reform_started(105.0)  # a second failure does not push it back
    assert not book.reform_overdue(by - 0.1)
    assert book.reform_overdue(by)
    assert not book.reform_overdue(by + 1)  # once
    book.reform_started(200.0)
    book.reform_ended()
    assert not book.reform_overdue(1e9)


def test_a_node_re_forms_as_soon_as_every_local_worker_left_the_current_round_on_its_own():
    # Issue 31: a peer's process died, every local collective raised; the agent joins the
    # next round at once instead of waiting for the rendezvous to count the peer dead.
    left = {0: (4, True, "reset"), 1: (4, True, "reset")}
    assert job_rules.all_left(2, 4, left)
    assert not job_rules.all_left(2, 4, {0: (4, True, "reset")})  # one still in the group
    assert not job_rules.all_left(2, 5, left)  # notes of an older round: already re-formed
    assert not job_rules.all_left(2, 4, {0: (4, True, ""), 3: (4, True, "")})  # not local
    assert not job_rules.all_left(0, 4, {})

"""The round decisions of elasticd's own rendezvous, as pure functions on plain data.

The rendezvous (:mod:`elasticd.rendezvous.handler`) keeps, per run, one small key per node and a
few control keys (:mod:`.records`), instead of torch's single pickled blob. A node joins by
(re)writing its own record with the round it wants (``target``); its lease is its heartbeat, so
nothing is rewritten on a timer. One agent, the *closer*, elected under its lease, follows the
node records (incrementally: :mod:`.tally`) and writes the round key by one compare-and-set that
also checks its own election key; the other agents follow only the control keys. Everything
here decides from plain data and does no I/O, so it is tested alone
(``tests/unit/test_rendezvous_rounds.py``).

The rules, for the next round ``t`` after the last closed round ``t - 1`` with members ``M``:

* **Joined.** A live node has joined round ``t`` when it is not a member of ``M`` (a newcomer or
  a spare: it waits for whatever round comes next) or its record asks for a round ``>= t`` (a
  member that came back to re-rendezvous). A member of ``M`` still asking for ``t - 1`` is
  training.
* **When to close.** Never below ``min`` joined nodes, nor while a live member of ``M`` has not
  joined (its workers are about to fail and come back; closing without it would split the job).
  At ``max`` joined, at once. With live members of ``M`` (a re-rendezvous after a failure or a
  grow): as soon as every one of them has joined, so no last call; the live nodes of the job are
  then all in. With none (a job's first round, or every member gone): after ``last_call``
  seconds from the moment ``min`` was reached, so late starters get in.
* **Ranks.** A survivor of ``M`` keeps its rank when that rank still exists in the new round,
  so the snapshot it holds for that rank stays local. The free places, lowest first, go to the
  survivors whose rank no longer exists (in their order in ``M``), then to newcomers by the
  revision that created their record (arrival order), ties by node id. When the highest ranks
  were lost this is plain order-keeping; when a middle rank was lost, only the displaced top
  ranks move, rather than every rank above the hole (each of which would lose its local
  snapshot). At most ``max`` form the round; the rest stay spares, and the next round takes
  them in that order, so a spare replaces a failed node (taking its rank) and the world size
  stays.
* **Waiting** (``num_nodes_waiting``, asked by each agent while its workers train, from the
  closer's summary :class:`~.records.Waiting`): members of the current round that came back to
  re-rendezvous, plus waiting non-members when the round has room (fewer than ``max`` of its
  members alive). A full round's spares wait silently; they are not a reason to restart
  anybody. The grow policy decides what room a newcomer may take:
  ``immediate`` (any: a node that returns or is added stops everybody once to enter) or
  ``at-failure`` (only a dead member's: it waits as a spare, and the next round that forms for
  another reason, a failure or a member's restart, takes it in with no extra stop) or
  ``interval:MIN`` (as ``at-failure``, and besides, once at least MIN minutes have passed since
  the last round that grew the job closed, or since its first round, any room, but only while
  the job is at a committed step: the stop then loses only the steps since that commit). The
  round record carries the wall-clock time of the last round that grew the job (``grew_at``,
  set by its closer), so every member, a restarted agent included, counts the interval from the
  same moment (clock skew between nodes shifts it by the skew, seconds against minutes).
  Whether the job is at a committed step is the caller's to say (``at_commit``): the
  replication records live outside this layer (see the handler's ``commit_gate``).
* **Dead.** A member counts as dead only once its record has been absent for ``confirm``
  seconds while the closer trusted its view of etcd (an etcd paused past the TTL expires every
  lease at once), and an agent that distrusts its own view counts nobody as dead.
* **The summary** is rewritten when what it means changes (whether anyone rejoins, whether
  anyone waits outside, who is dead: :func:`summary_news`) at once, and its exact counts at
  most every :data:`SUMMARY_REFRESH` seconds: a re-rendezvous of N members costs each agent
  one or two events, not N.
* **Election.** When the closer's key is gone (its lease expired, it left, or the daemons
  recorded its node failed), each agent waits :func:`election_delay` and then, if nobody took
  the key meanwhile, tries to create it: the members of the last round in rank order, a step
  apart, so one takes over and the others see its key before their turn (no herd). The
  closer that went has no turn: the next rank takes its place at once (before, a closer of
  rank 0 that died cost every re-formation a step, 50 ms, before anyone took over).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from elasticd.rendezvous.records import NodeRecord, RoundRecord, Waiting

#: Grow policies (rdzv-conf ``grow``; see the module docstring); ``interval:MIN`` takes a
#: number of minutes.
GROW_POLICIES = ("immediate", "at-failure", "interval:MIN")
_INTERVAL = "interval:"


def check_grow(policy: str) -> str:
    """Validates a grow policy and returns it normalized (``interval:MIN`` with MIN as given)."""
    text = str(policy).strip()
    if text in ("immediate", "at-failure"):
        return text
    if text.startswith(_INTERVAL):
        raw = text[len(_INTERVAL):]
        try:
            minutes = float(raw)
        except ValueError:
            minutes = float("nan")
        if minutes >= 0 and minutes != float("inf"):  # refuses NaN, negatives, junk
            return _INTERVAL + raw.strip()
        raise ValueError(f"grow policy {policy!r}: MIN in interval:MIN must be a finite "
                         f"number of minutes >= 0")
    raise ValueError(f"grow policy {policy!r}: use immediate, at-failure or interval:MIN "
                     f"(MIN minutes, e.g. interval:30)")


def grow_interval(policy: str) -> float | None:
    """Seconds of an ``interval:MIN`` policy; None for the other policies (:func:`check_grow`
    refuses a policy that is not one)."""
    text = check_grow(policy)
    return float(text[len(_INTERVAL):]) * 60.0 if text.startswith(_INTERVAL) else None


def next_round(last: RoundRecord | None) -> int:
    return 0 if last is None else last.round + 1


def joined(nodes: Mapping[str, NodeRecord], last: RoundRecord | None) -> list[str]:
    """Live nodes that have joined the next round (see the module docstring), unordered."""
    t = next_round(last)
    members = set(last.members) if last is not None else set()
    return [n for n, rec in nodes.items() if n not in members or rec.target >= t]


def order(candidates: Iterable[str], nodes: Mapping[str, NodeRecord],
          last: RoundRecord | None, size: int | None = None) -> list[str]:
    """Rank order of ``candidates`` (the module docstring's **Ranks**); the first ``size``
    (all by default) form the round, whoever is left over is a spare."""
    pool = set(candidates)
    size = len(pool) if size is None else min(size, len(pool))
    previous = last.members if last is not None else ()
    slots: list[str | None] = [None] * size
    displaced = []
    for rank, m in enumerate(previous):
        if m not in pool:
            continue
        if rank < size:
            slots[rank] = m
        else:
            displaced.append(m)
    placed = set(previous) & pool
    newcomers = sorted((n for n in pool if n not in placed),
                       key=lambda n: (nodes[n].revision if n in nodes else 0, n))
    rest = iter(displaced + newcomers)
    ranked = [s if s is not None else next(rest) for s in slots]
    return ranked + list(rest)


@dataclasses.dataclass(frozen=True)
class CloseDecision:
    """What a node should do about the next round, given its view.

    Attributes:
        members: the round to write (rank order) when it may close now, else None.
        wait_for: why not, for logs (e.g. "2 live members still training").
        last_call: True when the round may close once the last call is over, counted from
            when ``min`` joined were first seen (the caller keeps that time).
    """

    members: tuple[str, ...] | None
    wait_for: str = ""
    last_call: bool = False


def decide_close(nodes: Mapping[str, NodeRecord], last: RoundRecord | None,
                 min_nodes: int, max_nodes: int, last_call_over: bool) -> CloseDecision:
    """Whether the next round can close now, and with whom.

    Args:
        nodes: live node records (those whose key exists), by node id.
        min_nodes, max_nodes: torchrun's ``--nnodes MIN:MAX``.
        last_call_over: whether ``last_call`` seconds have passed since this node first saw
            ``min`` joined (only consulted when no member of ``last`` is alive).
    """
    candidates = joined(nodes, last)
    live_members = [m for m in (last.members if last else ()) if m in nodes]
    training = [m for m in live_members if nodes[m].target < next_round(last)]
    if training:
        return CloseDecision(None, f"{len(training)} live member(s) of round "
                                   f"{last.round if last else '-'} still training")
    if len(candidates) < min_nodes:
        return CloseDecision(None, f"{len(candidates)} of at least {min_nodes} nodes joined")
    ranked = order(candidates, nodes, last, max_nodes)
    if len(ranked) >= max_nodes or live_members:
        return CloseDecision(tuple(ranked[:max_nodes]))
    if last_call_over:
        return CloseDecision(tuple(ranked))
    return CloseDecision(None, f"{len(ranked)} nodes joined (min {min_nodes}, max {max_nodes}): "
                               "last call", last_call=True)


def grew_at(members: tuple[str, ...], last: RoundRecord | None, now: float) -> float:
    """``grew_at`` of a round of ``members`` closing at wall time ``now`` after ``last``: now
    when it is the job's first round or has more members than ``last``, else ``last``'s."""
    if last is None or len(members) > len(last.members):
        return now
    return last.grew_at


def num_waiting(current: RoundRecord | None, waiting: Waiting | None, max_nodes: int,
                gone: Iterable[str] = (), grow: str = "immediate", now: float = 0.0,
                at_commit: bool = True) -> int:
    """``num_nodes_waiting`` for a member of ``current`` (see the module docstring).

    Args:
        current: the last closed round (None: none, although this agent trains: the record is
            gone, so everybody re-rendezvous).
        waiting: the closer's summary (one of an older round counts as nobody waiting).
        max_nodes: torchrun's ``--nnodes`` maximum.
        gone: members of ``current`` this agent counts as dead (the summary's, unless it
            distrusts its own view: then none). A member absent but not yet confirmed is
            counted as alive (provisional expiry).
        grow: the grow policy (:data:`GROW_POLICIES`; the module docstring's **Waiting**).
        now: wall-clock time (``interval:MIN`` only).
        at_commit: whether the job is at a committed step (``interval:MIN`` only).
    """
    number = current.round if current is not None else -1
    if waiting is None or waiting.round != number:
        waiting = Waiting(number)
    if current is None:
        # Asked while training, yet no round: the round record is gone (etcd lost its data,
        # or it was deleted), so every node re-rendezvous, as for a member that came back.
        return max(1, waiting.outsiders)
    members = set(current.members)
    dead = set(gone) & members
    alive_members = len(members - dead)
    interval = grow_interval(grow)
    any_room = grow == "immediate" or (
        interval is not None and at_commit and now - current.grew_at >= interval)
    room = max_nodes - alive_members if any_room else min(len(dead), max_nodes - alive_members)
    return waiting.rejoining + (min(waiting.outsiders, room) if room > 0 else 0)


#: Seconds between two rewrites of the waiting summary that change only its counts.
SUMMARY_REFRESH = 5.0


def summary_news(written: Waiting | None, new: Waiting) -> bool:
    """Whether ``new`` says something ``written`` (the summary in etcd; None: none for this
    round, which reads as nobody waiting) does not: another round, someone rejoining or
    waiting outside where nobody was (or the reverse), other dead members. The counts alone
    are refreshed every :data:`SUMMARY_REFRESH` seconds instead."""
    if written is None or written.round != new.round:
        written = Waiting(new.round)
    def meaning(w: Waiting) -> tuple:
        return (w.round, w.rejoining > 0, w.outsiders > 0, w.dead)
    return meaning(written) != meaning(new)


#: Seconds between the turns of two successive ranks to take the closer's key.
ELECTION_STEP = 0.05
#: Ranks that take turns; the rest (and spares, newcomers) draw a moment after them.
ELECTION_RANKS = 16
#: Spread of the drawn moments, seconds.
ELECTION_JITTER = 0.5


def election_delay(me: str, last: RoundRecord | None, draw: float,
                   went: str | None = None) -> float:
    """Seconds this node waits, once the closer's key is gone, before it tries to take it
    (the module docstring's **Election**; ranks past :data:`ELECTION_RANKS` draw after the
    ranked turns, and before the job's first round every node draws within four steps).

    Args:
        draw: a number in [0, 1), drawn by the caller.
        went: the node whose closer's key went (None: not known).
    """
    if last is None:
        return draw * ELECTION_STEP * 4
    rank = last.rank_of(me)
    gone = last.rank_of(went) if went is not None and went != me else None
    if rank is not None and gone is not None and gone < rank:
        rank -= 1
    if rank is not None and rank < ELECTION_RANKS:
        return ELECTION_STEP * rank
    return ELECTION_STEP * ELECTION_RANKS + draw * ELECTION_JITTER

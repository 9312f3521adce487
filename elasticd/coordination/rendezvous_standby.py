"""A fix for torch 2.13's standby-node livelock, applied to the state the backend hands torch.

The livelock (docs/facts.md): with a standby node (``--nnodes N:N`` and N+1 agents), a worker crash
on one node sends that node into the *wait list* of the next round. The standby leaves the
redundancy list for the wait list too, the others see nodes waiting and restart, and all N+1
agents race for N slots. The loser is left in the wait list of a round that is complete and
full: no slot will open for it, yet ``num_nodes_waiting()`` keeps counting it, so every
participant restarts its workers again, about twice a second, forever (these restarts do not
count against ``--max-restarts``). Left alone, the loser would also leave torchrun after the
join timeout, since the wait list, unlike the redundancy list, honours it.

The fix: whenever the state torch reads shows a complete, open round whose participants fill
``max_nodes``, every node still in the wait list is moved to the redundancy list. That is where
torch itself puts a node that arrives at a full round: it waits there without a timeout and
re-enters the wait list as soon as a slot opens (a participant leaves), which is the moment a
restart can admit it. ``num_nodes_waiting()`` then reads 0 for a full round. The rewrite is
deterministic, so every agent sees the same state; it reaches etcd with the next write of any
agent, under the same fencing token.

With lease liveness on, its dead-node filter runs first; participants it marked dead do not
count toward a full round.

This reads torch's private ``_RendezvousState`` (attributes ``complete``, ``closed``,
``participants``, ``wait_list``, ``redundancy_list``). If a future torch changes them, the state
is passed through unchanged with one warning, and the livelock test in
``tests/integration/test_rendezvous_standby.py`` tells whether the fix is still needed.
Unpickling here adds no exposure: torch unpickles the very same bytes a moment later.
"""

from __future__ import annotations

import logging
import pickle

from elasticd.coordination.rendezvous_liveness import is_marked_dead

log = logging.getLogger(__name__)

_warned = False


class ParkWaitingNodesWhenFull:
    """State filter: wait-listed nodes of a complete, full round go to the redundancy list.

    Args:
        max_nodes: the rendezvous' maximum number of nodes (torchrun ``--nnodes``' upper bound).

    Raises:
        ValueError: ``max_nodes`` below 1.
    """

    def __init__(self, max_nodes: int) -> None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes {max_nodes!r} must be at least 1")
        self.max_nodes = max_nodes

    def __call__(self, state_bits: bytes) -> bytes:
        global _warned
        try:
            state = pickle.loads(state_bits)
        except Exception:  # torch raises its own RendezvousStateError on these bytes
            return state_bits
        try:
            # A participant that lease liveness just marked dead leaves when torch sanitizes
            # this state: it does not fill a slot (the waiting node will take it).
            live = [p for p in state.participants if not is_marked_dead(state, p)]
            stuck = (state.complete and not state.closed
                     and len(live) >= self.max_nodes and state.wait_list)
            if not stuck:
                return state_bits
            log.info("round is complete and full: moving %d waiting node(s) to the redundancy "
                     "list (%s)", len(state.wait_list),
                     ", ".join(sorted(map(repr, state.wait_list))))
            state.redundancy_list.update(state.wait_list)
            state.wait_list.clear()
        except AttributeError as exc:
            if not _warned:
                _warned = True
                log.warning("torch's rendezvous state has changed shape (%s); the standby "
                            "livelock fix is off", exc)
            return state_bits
        return pickle.dumps(state)

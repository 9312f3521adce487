"""Keeping a job recoverable and getting its state back: the daemon side of recovery.

:mod:`~elasticd.recovery.replicator` is the node's replication service: it pushes each local
snapshot to the peers the placement names (:mod:`elasticd.replication` moves and commits
them), re-replicates a committed step when its holders change, fetches shards for a restore
and hands replicas off before a drain. :mod:`~elasticd.recovery.fetch` gets a shard back from
whichever holder has an intact copy, striped across holders, every byte verified;
:mod:`~elasticd.recovery.plans` decides, as pure functions of the committed record and the
placement, which copies to push to keep ``m`` and which replicas to free;
:mod:`~elasticd.recovery.drain` runs ``elasticctl drain`` and the hand-off before a clean exit,
against a :class:`~elasticd.recovery.drain.DrainHost`.

Layering: this package uses :mod:`elasticd.replication` (transport, pushes, commits) and
:mod:`elasticd.store` (slots); neither imports it. The worker side of a restore (agreeing on a
step, loading it) is :mod:`elasticd.worker.restore`; the checkpoint store's ``ckpt_fetch`` reaches
the replicator through :class:`elasticd.store.api.Replication`. No torch.
"""

"""The snapshot format both sides share: what a snapshot's bytes mean, never how they move.

:mod:`~elasticd.snapshot.format` is the layout (a checksummed JSON header plus raw, aligned
tensor bytes), :mod:`~elasticd.snapshot.reader` reads it back in place, and
:mod:`~elasticd.snapshot.segment` is one slot file in shared memory: allocated and verified by
the daemon, mapped by workers from the descriptor it hands them. The worker side (:mod:`elasticd.worker`) writes and reads snapshots,
the daemon side (:mod:`elasticd.store`, :mod:`elasticd.replication`, :mod:`elasticd.persistence`)
holds, moves and persists them; both import this package and it imports neither. No torch.
"""

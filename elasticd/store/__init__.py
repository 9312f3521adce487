"""The node's checkpoint store: the daemon side of in-RAM checkpoints.

:mod:`~elasticd.store.shm` owns the shared-memory slots that hold snapshots (this node's ranks'
own and its peers' replicas), :mod:`~elasticd.store.service` answers the workers' ``ckpt_*``
requests over the local API (the snapshot path in :mod:`~elasticd.store.service_snapshots`, the
restore path in :mod:`~elasticd.store.service_restores`), :mod:`~elasticd.store.protection`
decides when a job is unprotected, and :mod:`~elasticd.store.telemetry` is what the service
reports to the metrics. What the store hands out and the errors it raises are in
:mod:`~elasticd.store.api`. It runs in the daemon only and never imports torch or the worker
side (:mod:`elasticd.worker`); the snapshot format it shares with the worker is
:mod:`elasticd.snapshot`.
"""

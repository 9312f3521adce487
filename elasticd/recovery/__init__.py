"""Keeping a job recoverable and getting its state back: the daemon side of recovery.

Above :mod:`elasticd.replication` and :mod:`elasticd.store` (neither imports it); its modules,
one line each: docs/architecture.md. No torch.
"""

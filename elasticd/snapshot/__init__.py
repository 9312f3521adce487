"""The snapshot format both sides share: what a snapshot's bytes mean, never how they move.

The worker side (:mod:`elasticd.worker`) and the daemon side (:mod:`elasticd.store`,
:mod:`elasticd.replication`, :mod:`elasticd.persistence`) both import this package and it
imports neither. No torch. Its modules, one line each: docs/architecture.md.
"""

"""The node's checkpoint store: the daemon side of in-RAM checkpoints.

Daemon only: it never imports torch or the worker side; the snapshot format it shares with the
worker is :mod:`elasticd.snapshot`. Its modules, one line each: docs/architecture.md.
"""

"""The persistent tier: complete snapshots flushed to a (shared) filesystem.

Daemon side: none of it imports torch, and nothing here is ever pickled or unpickled. Its
modules, one line each: docs/architecture.md.
"""

"""Test doubles and helpers for elasticd's tests and benchmarks; never imported by the product.

Here live the in-memory coordinator (:mod:`elasticd.testing.coordination`), the in-memory
replication sink (:mod:`elasticd.testing.replication`), the checkpoint service called in
process (:mod:`elasticd.testing.transport`), the clock that moves only when told to
(:mod:`elasticd.testing.clock`) and helpers the tests share (:mod:`elasticd.testing.snapshot`).
An import contract in ``pyproject.toml`` keeps every other module of elasticd from importing
this package, and ``tests/unit/test_doubles_placement.py`` keeps doubles from growing back
beside the product's modules.
"""

"""The join's figure in bench/scale_native.py (``join_seconds``): with ``--agents-started``
the simulated agents' own start (lease, control watch, duty thread, a thread each) runs before
the clock, and the join is timed from its first join record sent to the last agent returned
into the round; without, from the driver's start, as before."""

from __future__ import annotations

from tests.bench_modules import load


def _join(seconds, first):
    return {"seconds": seconds, "timeline": {"first_record_sent": first}}


def test_with_the_agents_started_the_join_is_timed_from_its_first_join_record():
    native = load("scale_native")
    assert native.join_seconds(_join(1.357, 0.011), started=True) == 1.346
    assert native.join_seconds(_join(6.1, 0.3), started=False) == 6.1  # the old definition
    assert native.join_seconds(_join(None, 0.011), started=True) is None  # not one round
    assert native.join_seconds(_join(1.2, None), started=True) == 1.2  # no record timed

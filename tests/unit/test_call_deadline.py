"""Whole-call deadlines: floor + slack * bytes / measured rate, with a default before any
measurement."""

from __future__ import annotations

import pytest

from elasticd.testing.clock import FakeClock
from elasticd.replication.deadline import (
    DEFAULT_FLOOR,
    DeadlinePolicy,
    LinkRates,
)

MB = 1_000_000


def test_a_call_moving_nothing_gets_the_floor():
    assert LinkRates().deadline("b", 0) == DEFAULT_FLOOR


def test_the_deadline_grows_with_the_bytes_and_shrinks_with_the_rate():
    rates = LinkRates(DeadlinePolicy(floor=2.0, slack=4.0, default_rate=50 * MB), alpha=1.0)
    over = {n: rates.deadline("b", n * MB) - 2.0 for n in (100, 200)}  # beyond the floor
    assert over[100] > 0 and over[200] == pytest.approx(2 * over[100])  # in step with the bytes
    rates.record("b", 200 * MB, 1.0)  # measured at 4x the default rate
    assert rates.deadline("b", 100 * MB) - 2.0 == pytest.approx(over[100] / 4)


def test_an_unmeasured_peer_gets_the_conservative_default():
    rates = LinkRates(DeadlinePolicy(floor=1.0, slack=2.0, default_rate=10 * MB))
    assert rates.rate("b") == 10 * MB
    assert rates.deadline("b", 20 * MB) == pytest.approx(1.0 + 4.0)


def test_measured_transfers_move_the_rate_as_a_weighted_mean():
    clock = FakeClock()
    rates = LinkRates(DeadlinePolicy(floor=1.0, slack=1.0), alpha=0.5)
    started = clock.monotonic()
    clock.advance(0.1)  # 100 MB in 0.1 s
    rates.record("b", 100 * MB, clock.monotonic() - started)
    assert rates.rate("b") == pytest.approx(1000 * MB)
    rates.record("b", 100 * MB, 1.0)
    assert rates.rate("b") == pytest.approx(550 * MB)
    assert rates.deadline("b", 550 * MB) == pytest.approx(2.0)
    assert rates.rate("c") == DeadlinePolicy().default_rate  # per peer


def test_transfers_too_small_to_measure_the_link_are_ignored():
    rates = LinkRates()
    rates.record("b", 4096, 0.001)
    rates.record("b", 100 * MB, 0.0)
    assert rates.rate("b") == DeadlinePolicy().default_rate


@pytest.mark.parametrize("kw", [{"floor": 0}, {"slack": 0.5}, {"default_rate": 0}])
def test_a_bad_policy_is_refused(kw):
    with pytest.raises(ValueError):
        DeadlinePolicy(**kw)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        LinkRates().deadline("b", -1)
    with pytest.raises(ValueError):
        LinkRates(alpha=0)

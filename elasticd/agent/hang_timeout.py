"""How long a worker may go without progress: the learned rule's home is
:mod:`elasticd.cluster.learned_timeout`, below the worker side, which learns its collective
timeout by the same rule (:mod:`elasticd.worker.collective_timeout`); this module keeps the
names the daemon's side imports."""

from __future__ import annotations

from elasticd.cluster.learned_timeout import (FACTOR, MAX_DOUBLINGS, WARMUP_STEPS, WINDOW,
                                              LearnedTimeout, SlidingMax, StepHistory)

__all__ = ["FACTOR", "MAX_DOUBLINGS", "WARMUP_STEPS", "WINDOW", "LearnedTimeout", "SlidingMax",
           "StepHistory"]

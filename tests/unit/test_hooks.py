"""The one loop every caller of hooks uses (fencing, job end, the local API's connection close
and undelivered reply, commits learned, progress and restore reports): each hook runs even when
one before it raises, the failure is logged on the caller's logger with the caller's words, and
a hook added while they run waits for the next call (the old loops of the fence and job-end
hooks iterated the live list: an appended hook ran at once)."""

from __future__ import annotations

import logging

from elasticd.hooks import call_hooks


def test_every_hook_runs_and_a_failure_is_logged_on_the_callers_logger(caplog):
    seen: list[tuple] = []
    hooks = [lambda *a: seen.append(("first", *a)), lambda *a: 1 / 0,
             lambda *a: seen.append(("last", *a))]
    log = logging.getLogger("elasticd.some.caller")
    with caplog.at_level(logging.ERROR):
        call_hooks(hooks, "job", 3, log=log, failed="job-end hook failed for job 100%")
    assert seen == [("first", "job", 3), ("last", "job", 3)]
    [record] = caplog.records
    assert (record.name, record.getMessage()) == ("elasticd.some.caller",
                                                  "job-end hook failed for job 100%")
    assert record.exc_info[0] is ZeroDivisionError


def test_a_hook_added_by_a_hook_runs_from_the_next_call_on():
    calls: list[str] = []
    hooks: list = []
    hooks.append(lambda: (calls.append("a"), hooks.append(lambda: calls.append("b"))))
    call_hooks(hooks, log=logging.getLogger(__name__), failed="x")
    assert calls == ["a"]
    call_hooks(hooks[1:], log=logging.getLogger(__name__), failed="x")
    assert calls == ["a", "b"]

"""A signal that arrives while the main thread holds the lock of the Event it will set.

Each case runs in a child process (a deadlock there must not hang pytest): the main thread
takes the Event's internal lock, as ``Event.wait`` and ``Event.clear`` do for a moment on
every cycle of the daemon's loop, signals itself, runs bytecodes (where Python runs signal
handlers), releases the lock and waits for the Event.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from elasticd.agent.signals import SignalRelay

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading
    from elasticd.agent.signals import SignalRelay
    stop = threading.Event()
    if sys.argv[1] == "relay":
        relay = SignalRelay({signal.SIGTERM: stop.set})
    else:  # what the daemon did before: the Python handler sets the Event itself
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    with stop._cond:  # the Event's own lock, held as Event.wait/clear hold it
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):  # bytecodes: the handler runs here
            pass
    print("stopped" if stop.wait(10) else "never stopped", flush=True)
""")


def _run(mode: str, timeout: float) -> str | None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out.strip()
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_handler_that_sets_the_event_deadlocks_on_its_own_lock():
    # The hazard the relay exists for: without it the process never gets past the signal.
    assert _run("direct", timeout=3.0) is None


def test_the_relay_delivers_the_signal_while_the_lock_is_held():
    assert _run("relay", timeout=20.0) == "stopped"


def test_the_relay_calls_each_handler_and_puts_back_the_handlers_on_close():
    calls: list[int] = []
    two = threading.Event()

    def on_usr2() -> None:
        calls.append(signal.SIGUSR2)
        if len(calls) == 2:
            two.set()

    relay = SignalRelay({signal.SIGUSR2: on_usr2})
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert two.wait(10), f"calls so far: {calls}"
    finally:
        relay.close()
    assert calls == [signal.SIGUSR2, signal.SIGUSR2]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    assert not relay._thread.is_alive()


def test_close_puts_back_the_handler_the_relay_replaced():
    """A process that had its own handler (the in-process agent's host, a test) gets it back,
    not the default (SIGUSR2's default ends the process)."""
    def own(signum, frame):
        return None

    before = signal.signal(signal.SIGUSR2, own)
    try:
        relay = SignalRelay({signal.SIGUSR2: lambda: None})
        try:
            assert signal.getsignal(signal.SIGUSR2) is not own
        finally:
            relay.close()  # its thread and pipe, even when the assertion fails
        assert signal.getsignal(signal.SIGUSR2) is own
    finally:
        signal.signal(signal.SIGUSR2, before)

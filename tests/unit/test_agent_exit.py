"""The daemon's torchrun agent leaves without the interpreter's teardown, owing nothing.

Run in child processes: what is checked is how a process ends.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# The agent's process: an object only the interpreter's finalization would delete, an atexit
# handler, a non-daemon thread still working and an executor's idle worker (joined through its
# exit hook, not by the thread join alone) when the agent's run ends.
AGENT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    marks, how = sys.argv[1], sys.argv[2]

    def mark(name):
        open(os.path.join(marks, name), "w").close()

    class Finalized:  # bound now: modules are half gone when finalization deletes it
        def __del__(self, path=os.path.join(marks, "finalized"), open=open):
            open(path, "w").close()

    keep = Finalized()
    atexit.register(mark, "atexit")
    threading.Thread(target=lambda: (time.sleep(0.3), mark("thread"))).start()
    ThreadPoolExecutor(1).submit(lambda: None).result()
    from elasticd.agent import torchrun
    if how == "torchrun":
        # torchrun's own log directory, else it leaves a torchelastic_* one in /tmp
        sys.argv = ["torchrun", "--standalone", "--nproc-per-node", "1",
                    "--log-dir", os.path.join(marks, "logs"), os.path.join(marks, "worker.py")]
        torchrun.main()
    else:
        torchrun.leave(how)
""")


def run_agent(tmp_path: Path, how: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "worker.py").write_text("print('worker ran', flush=True)\n")
    return subprocess.run([sys.executable, "-c", AGENT, str(tmp_path), how], cwd=Path.cwd(),
                          capture_output=True, text=True, timeout=120)


def marks(tmp_path: Path) -> set[str]:
    return {p.name for p in tmp_path.iterdir() if p.is_file() and p.suffix != ".py"}


def test_a_finished_agent_skips_finalization_but_owes_its_threads_and_atexit_handlers(tmp_path):
    done = run_agent(tmp_path, "torchrun")

    assert done.returncode == 0, done.stderr
    assert "worker ran" in done.stdout
    # The interpreter's teardown (where the seconds go) did not run; what exit owes did.
    assert marks(tmp_path) == {"atexit", "thread"}


def test_an_exit_with_a_message_prints_it_and_fails_as_the_interpreter_would(tmp_path):
    done = run_agent(tmp_path, "agent refused: bad spec")

    assert done.returncode == 1
    assert done.stderr.strip().endswith("agent refused: bad spec")
    assert marks(tmp_path) == {"atexit", "thread"}

"""No module uses a name it never defines or imports. Such a name fails only when its line
runs: the demo (README's first command) once ended in a NameError after its whole run,
because an import was lost in a change that no test of that line caught. pyflakes finds
them statically."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_no_module_uses_an_undefined_name():
    res = subprocess.run([sys.executable, "-m", "pyflakes", "elasticd", "bench", "tests"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    undefined = [ln for ln in res.stdout.splitlines() + res.stderr.splitlines()
                 if "undefined name" in ln]
    assert not undefined, "\n".join(undefined)
    # pyflakes itself ran (without it, "No module named pyflakes" and nothing checked)
    assert "Traceback" not in res.stderr and "No module named" not in res.stderr, res.stderr

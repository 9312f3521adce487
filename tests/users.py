"""Local users made by the tests that play a job's user or a hostile local user.

CI runs as root, so the tests that show what another uid can or cannot do create that uid
(``useradd``) and remove it (``userdel``) rather than skip. Names are random: parallel sessions
on one machine do not collide.
"""

from __future__ import annotations

import contextlib
import pwd
import subprocess
import uuid
from typing import Iterator


@contextlib.contextmanager
def temporary_user(prefix: str = "edt") -> Iterator[pwd.struct_passwd]:
    """A new system user without a home or a login shell, removed on exit."""
    name = f"{prefix}{uuid.uuid4().hex[:10]}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    "--user-group", name], check=True, capture_output=True, timeout=30)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)

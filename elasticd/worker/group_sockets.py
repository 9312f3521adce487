"""A round's gloo connections, ended at once (issue 31: the leave cascade).

Shutting a connection down (``shutdown(2)``) ends the pending operation on both sides at once,
where gloo's ``abort()`` and ``shutdown()`` do not: why a leave starts with it, what it saved
and the spikes that show it are in docs/jobs.md, "Leaving the old group at once".

The descriptors stay gloo's: each is shut down through a duplicate that is then closed, and
``destroy_process_group`` closes the originals, so no descriptor number can be reused under
gloo while it still holds it. Only connected pairs: shutting gloo's listening socket down too
makes its device thread throw ``gloo::EnforceNotMet`` outside any handler, and the process dies
of SIGABRT (bench/spikes/inprocess/gloo_shutdown.py's ``all`` case; an earlier spike that shut
every socket of the group lost every survivor so: in-process-design.md, section 1). The round's
store (its port, either end) is not the group and is left alone as well.
"""

from __future__ import annotations

import os
import socket
from typing import Iterable


def connections(fds: Iterable[int], store_port: int) -> set[int]:
    """The connected TCP sockets among ``fds`` that are not the round store's (neither end on
    ``store_port``): the group's pairs."""
    out = set()
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile, or not a socket
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) \
                    or s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            local, peer = s.getsockname()[1], s.getpeername()[1]
        except OSError:
            continue  # not connected
        finally:
            s.close()
        if store_port not in (local, peer):
            out.add(fd)
    return out


def shut_down(fds: Iterable[int]) -> int:
    """Shuts down each connection of ``fds`` both ways (the descriptors stay open); returns how
    many were."""
    done = 0
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass  # already reset by the peer
        finally:
            s.close()
    return done

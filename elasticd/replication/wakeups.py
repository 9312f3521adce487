"""Fewer wake-ups for a bulk receive: the TCP receive low-water mark (``SO_RCVLOWAT``).

A receiver blocked on a TCP socket is woken as each segment lands (64 KiB at a time on
loopback, a GRO batch from a NIC), and each wake-up is a context switch, a ``poll`` and a
``recv_into`` that returns a small piece. Raising the socket's low-water mark for the bulk of a
large read makes the kernel wake the reader only once :data:`RECV_MARK` bytes wait, so a 4 MiB
DATA frame is a handful of large receives instead of dozens. On this 2-core host that alone
made the verified floor's own receiver 1.2-1.3x faster (bench/results/restore44/spike/lowat.txt).

Three rules keep a raised mark from ever waiting on bytes that will not come, the third below:

* for the last part of a read the mark is lowered to exactly what is left of it, and after the
  read (however it ends) back to 1, so the next frame header, or a short final frame, is read
  as soon as it lands;
* the mark is at most a quarter of the receive buffer the kernel granted; and Linux wakes a
  reader whose receive window is used up whatever its mark, so even a mark larger than the
  window slows a transfer, never stalls it. A peer that closes or stalls mid-read ends the
  wait as before (end of stream, or the socket's timeout).

Third: only plain TCP sockets with a timeout are marked. With a timeout, Python polls before each
receive and then takes what is there without waiting, and the kernel judges each poll by the
bytes waiting against the mark, which is never more than the read still needs. A blocking
receive instead copies what is there and then sleeps until a whole mark of *new* bytes waits,
however little it still needs: 700 KiB in, 800 KiB more to come, a 1 MiB mark, and it sleeps
forever (it did, in the bench's first floor under a mark). Every replication socket has a
timeout; one without is read as before. A TLS socket's reads are OpenSSL's records, not the
frame's bytes, and the test doubles that feed a channel bytes by hand have no such option.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from typing import Any

#: The low-water mark of a bulk read (bytes). 512 KiB, 1 MiB and 2 MiB gave 1.2x, 1.29x and
#: 1.3x the unmarked receive of the same bytes (bench/results/restore44/spike/lowat.txt).
RECV_MARK = 1 << 20


class ReceiveMark:
    """The low-water mark of one channel's socket, raised around bulk reads.

    Args:
        sock: the channel's socket; unmarked (every method a no-op) unless a plain TCP one.
    """

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._mark: int | None = None  # decided at the first bulk read (after tune())
        self._current = 1

    def bulk(self, need: int) -> bool:
        """Whether a read of ``need`` bytes is marked: at least two marks' worth, on a socket
        with a timeout now (see the module's docstring for why not a blocking one)."""
        if need < 2 * RECV_MARK:
            return False
        if self._mark is None:
            self._mark = _mark_for(self._sock)
        return self._mark > 0 and self._sock.gettimeout() is not None

    def left(self, remaining: int) -> None:
        """Before each receive of a marked read: wake for the mark, or for the last
        ``remaining`` bytes when fewer are left (raises OSError as the socket's calls do)."""
        self._set(min(self._mark or 1, remaining))

    def reset(self) -> None:
        """After a marked read, however it ended: wake for any byte again."""
        with contextlib.suppress(OSError):
            self._set(1)

    def _set(self, value: int) -> None:
        if value != self._current:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, value)
            self._current = value


def _mark_for(sock: Any) -> int:
    """:data:`RECV_MARK`, capped at a quarter of the receive buffer granted; 0 when ``sock``
    is not a plain TCP socket (or the buffer is too small for a mark to help)."""
    if not isinstance(sock, socket.socket) or isinstance(sock, ssl.SSLSocket):
        return 0
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return 0
    try:
        granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    except OSError:
        return 0
    mark = min(RECV_MARK, granted // 4)
    return mark if mark >= 64 << 10 else 0

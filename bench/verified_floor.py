"""The verified floor of a restore from peers' RAM: the same bytes over raw TCP, each 4 MiB block
checked by its receiver against a ChaCha20-Poly1305 tag made once beforehand, and nothing else.

Any restore that authenticates every byte it takes from a peer does at least this: the senders
send blocks whose tags were made before (as a seal makes them), and the receiver feeds each
block's Poly1305 the pieces ``recv_into`` returns, as they land, and compares. Written against
``cryptography`` and the socket module alone, so that no elasticd code is in the floor; the
sockets get the product's options (no Nagle delay, 4 MiB buffers each way) by hand.

On the wire, per block: nonce (8, the block's number in the sender's buffer) | tag (16) | block,
the 24 bytes in front of each block the product's pretagged frames carry too. Used by
``bench_peer_restore.py`` and ``bench_sharded_restore.py``.
"""

from __future__ import annotations

import socket
import struct
from typing import Callable

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.poly1305 import Poly1305

BLOCK = 4 << 20
KEY = bytes(range(32))  # both ends know it: a floor, not a protocol
PREFIX = struct.Struct("<Q16s")  # nonce, tag
_PAD = bytes(16)


def tune(sock: socket.socket) -> None:
    """The product's replication socket options: no Nagle delay, 4 MiB buffers each way."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)


def recv_exactly(sock: socket.socket, view: memoryview,
                 feed: Callable[[memoryview], None] | None = None) -> None:
    """Fills ``view`` from ``sock``; ``feed`` is given each piece as it lands."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed early")
        if feed is not None:
            feed(view[got : got + n])
        got += n


def _nonce(n: int) -> bytes:
    return struct.pack("<IQ", 0, n)


class BlockMac:
    """RFC 8439's ChaCha20-Poly1305 tag of one block (empty plaintext, the block as associated
    data) under :data:`KEY` with nonce ``n``, fed piece by piece."""

    def __init__(self, n: int) -> None:
        one_time = Cipher(algorithms.ChaCha20(KEY, struct.pack("<I", 0) + _nonce(n)),
                          mode=None).encryptor().update(bytes(32))
        self._mac, self._length = Poly1305(one_time), 0

    def update(self, piece: memoryview) -> None:
        self._mac.update(piece)
        self._length += len(piece)

    def tag(self) -> bytes:
        self._mac.update(_PAD[: -self._length % 16])
        self._mac.update(struct.pack("<QQ", self._length, 0))
        return self._mac.finalize()


class TaggedSource:
    """What a floor's sender sends from: a buffer cut into 4 MiB blocks, each tagged once,
    here, before anything is timed (the last block may be shorter)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = memoryview(buf).cast("B")
        aead = ChaCha20Poly1305(KEY)
        self.blocks = [(off, min(off + BLOCK, len(self.buf)))
                       for off in range(0, len(self.buf), BLOCK)]
        self.tags = [aead.encrypt(_nonce(n), b"", self.buf[a:b])
                     for n, (a, b) in enumerate(self.blocks)]

    def send(self, sock: socket.socket, count: int | None = None) -> None:
        """Sends ``count`` blocks (default: every block once; more cycle through the buffer's
        whole blocks), each behind its nonce and tag."""
        whole = [n for n, (a, b) in enumerate(self.blocks) if b - a == BLOCK] or [0]
        order = (range(len(self.blocks)) if count is None
                 else [whole[i % len(whole)] for i in range(count)])
        for n in order:
            a, b = self.blocks[n]
            sock.sendall(PREFIX.pack(n, self.tags[n]))
            sock.sendall(self.buf[a:b])


def receive(sock: socket.socket, buf: memoryview, mark: int = 0) -> None:
    """Fills ``buf`` with blocks as :meth:`TaggedSource.send` sends them, checking each block
    against its tag as it lands.

    Args:
        mark: when not 0, each block is received under a receive low-water mark
            (``SO_RCVLOWAT``) of ``mark`` bytes, lowered to what is left for the block's tail
            and back to 1 for the next prefix: the kernel then wakes the receiver once per
            ``mark`` bytes instead of per segment (what elasticd's channel does, written here
            by hand; bench_peer_restore.py reports it as a second floor). The socket is given
            a timeout meanwhile, as elasticd's are: a blocking receive under a mark can sleep
            on bytes that will never come (elasticd/replication/wakeups.py says why).

    Raises:
        ValueError: a block fails its tag.
    """
    prefix = memoryview(bytearray(PREFIX.size))
    for off in range(0, len(buf), BLOCK):
        recv_exactly(sock, prefix)
        n, tag = PREFIX.unpack(prefix)
        mac = BlockMac(n)
        block = buf[off : off + BLOCK]
        if mark:
            _recv_marked(sock, block, mac.update, mark)
        else:
            recv_exactly(sock, block, mac.update)
        if mac.tag() != tag:
            raise ValueError(f"verified floor: the block at {off} fails its tag")


def _recv_marked(sock: socket.socket, view: memoryview, feed: Callable[[memoryview], None],
                 mark: int) -> None:
    got, current, timeout = 0, 1, sock.gettimeout()
    sock.settimeout(60.0)
    try:
        while got < len(view):
            want = min(mark, len(view) - got)
            if want != current:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                current = want
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("peer closed early")
            feed(view[got : got + n])
            got += n
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        sock.settimeout(timeout)

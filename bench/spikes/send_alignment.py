"""Spike (issue 30, restore41): does a frame's prefix, sent in one ``sendmsg`` with its 4 MiB
block, make the kernel's copy of the block dearer (the block's bytes landing at an odd offset
in the socket's buffers)?

elasticd's holders send each run as one ``sendmsg`` of its prefix and blocks; the verified
floor sends a 24-byte prefix and then the block, each with ``sendall``. This sends 1 GiB from a
``/dev/shm`` file (256 MiB, cycled) over loopback in 4 MiB blocks, each behind a ``k``-byte
prefix, in one ``sendmsg`` (``one``) or two ``sendall`` (``two``), and prints the sending
thread's CPU seconds per GiB (median of 5, and each run). Its output on restore41 is in
``bench/results/restore41/send_alignment.txt``::

    cpulock python bench/spikes/send_alignment.py
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import socket
import statistics
import time

GIB = 1 << 30
BLOCK = 4 << 20
PATH = "/dev/shm/elasticd-spike-align"


def sink(port: int) -> None:
    """Receives and drops every connection's bytes; a connection that sends none ends it."""
    listener = socket.create_server(("127.0.0.1", port))
    buf = memoryview(bytearray(BLOCK))
    while True:
        conn, _ = listener.accept()
        with conn:
            if conn.recv_into(buf) == 0:
                return
            while conn.recv_into(buf):
                pass


def tune(sock: socket.socket) -> None:
    """The product's send-side options (channel.tune)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)


def run(port: int, src: memoryview, k: int, mode: str) -> float:
    """The sending thread's CPU seconds for 1 GiB in 4 MiB blocks behind ``k``-byte prefixes."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        tune(sock)
        prefix = bytes(k)
        start = time.thread_time()
        for off in range(0, GIB, BLOCK):
            at = off % len(src)
            block = src[at : at + BLOCK]
            if mode == "one":
                views = [memoryview(prefix), block] if k else [block]
                while views:
                    n = sock.sendmsg(views)
                    while n:
                        if n >= len(views[0]):
                            n -= len(views.pop(0))
                        else:
                            views[0], n = views[0][n:], 0
            else:
                if k:
                    sock.sendall(prefix)
                sock.sendall(block)
        spent = time.thread_time() - start
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):
            pass
    return spent


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    receiver = mp.get_context("fork").Process(target=sink, args=(port,), daemon=True)
    receiver.start()
    time.sleep(0.3)
    fd = os.open(PATH, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 256 << 20)
        m = mmap.mmap(fd, 256 << 20)
        m.write(os.urandom(1 << 20) * 256)
        src = memoryview(m)
        cases = [(0, "one"), (24, "one"), (88, "one"), (4096, "one"), (24, "two"), (88, "two")]
        runs: dict[tuple[int, str], list[float]] = {c: [] for c in cases}
        for rep in range(5):
            for case in cases[rep % len(cases):] + cases[: rep % len(cases)]:
                runs[case].append(run(port, src, *case))
        for case, v in runs.items():
            print(case, round(statistics.median(v), 4), [round(x, 3) for x in v])
        src.release()
        m.close()
    finally:
        os.close(fd)
        os.unlink(PATH)
        with socket.create_connection(("127.0.0.1", port)) as sock:  # ends the sink
            sock.shutdown(socket.SHUT_WR)
        receiver.join(5)
        if receiver.is_alive():
            receiver.kill()


if __name__ == "__main__":
    main()

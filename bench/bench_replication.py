"""Replication throughput over loopback: elasticd's transport against raw-socket baselines.

Pushes ``--mib`` MiB from a preallocated, pre-touched buffer to a receiver (a separate process,
as a peer daemon would be) that writes into its own preallocated, pre-touched buffer, and
prints GB/s and the ratio to the raw socket:

* ``raw socket``: 4 MiB ``sendall`` / ``recv_into`` loops, nothing else (the ceiling);
* ``raw + xxh3``: the same, plus xxh3_64 of every chunk on both ends (the cost of checking);
* ``raw + Poly1305``: the same, plus a ChaCha20-Poly1305 tag of every chunk made and checked
  (the cost of the primitive alone, keys and nonces as the transport uses them);
* ``raw + GMAC (v2)``: the same with protocol v2's AES-GMAC tag instead, to compare the two
  primitives on the same socket in the same run;
* ``elasticd push``: :class:`~elasticd.replication.transport.ReplicaClient.push` to a
  :class:`~elasticd.replication.server.ReplicaServer` (handshake, then every frame framed and
  authenticated with ChaCha20-Poly1305 under the session key, committed into a sink whose memory
  is the preallocated buffer), with the tag pass inline as the product runs it;
* (the tag pass on a helper thread beside the socket copy was measured here until it was
  removed from the product: it bought nothing since protocol v3, cryptography's Poly1305
  holding the GIL; docs/replication.md.)

Where the time goes is printed too: CPU seconds per GiB on each side, and the tag pass alone
on one core (a 4 MiB buffer tagged in a loop, in this process, in the same run).

The target: ``elasticd push`` >= 0.8x ``raw socket`` (printed last, with the ratio).

Every socket, the raw baselines' too, gets the product's socket options
(:func:`elasticd.replication.channel.tune`: no Nagle delay, 4 MiB buffers each way), so the
ratio compares the framing and authentication alone.

Each figure is the median of ``--repeat`` transfers, timed from the first byte sent to the
receiver's final acknowledgement; connection setup is excluded from all three. CPU seconds per
GiB are summed over sender and receiver. Run with ``flock /tmp/elasticd-cpu.lock`` on shared
machines::

    python bench/bench_replication.py --mib 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import struct
import time
from typing import Any

import xxhash

from elasticd.replication import channel
from elasticd.replication.api import Descriptor, Sink, Version
from elasticd.replication.seal import BlockTagger, FrameKey
from elasticd.replication.transport import ReplicaClient, ReplicaServer

SECRET = b"bench-secret-0123456789abcdef"
MAC_KEY = bytes(range(32))  # the raw + Poly1305 baseline's fixed key (both ends build it)
PAGE = 4096
HEADER = b"{}".ljust(64, b" ")


class GmacKey:
    """Protocol v2's frame tag (AES-GMAC: AES-GCM, the frame as associated data), kept here
    only to measure it beside v3's ChaCha20-Poly1305 on the same socket in the same run."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers import algorithms

        self._algorithm, self._sequence = algorithms.AES(key), 0

    def _mode(self, tag: bytes | None = None):
        from cryptography.hazmat.primitives.ciphers import modes

        self._sequence += 1
        return modes.GCM(struct.pack("!IQ", 0, self._sequence), tag)

    def seal(self, *parts) -> bytes:
        from cryptography.hazmat.primitives.ciphers import Cipher

        encryptor = Cipher(self._algorithm, self._mode()).encryptor()
        for part in parts:
            encryptor.authenticate_additional_data(part)
        encryptor.finalize()
        return encryptor.tag

    def opener(self, tag: bytes):
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher

        decryptor = Cipher(self._algorithm, self._mode(tag)).decryptor()

        class Opener:
            update = decryptor.authenticate_additional_data

            @staticmethod
            def verify() -> bool:
                try:
                    decryptor.finalize()
                except InvalidTag:
                    return False
                return True

        return Opener()


KEYS = {"mac": FrameKey, "gmac": GmacKey}  # the per-chunk tags a raw variant can add


def touched(size: int) -> bytearray:
    """A buffer whose pages are already mapped (first-touch faults run at ~1.4 GB/s here)."""
    buf = bytearray(size)
    buf[::PAGE] = b"\1" * len(range(0, size, PAGE))
    return buf


class PreallocatedSink(Sink):
    """Receives every snapshot into one preallocated buffer (a stand-in for shared memory)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.buf = touched(size)
        self._held: Descriptor | None = None

    def allocate(self, d: Descriptor) -> memoryview:
        return memoryview(self.buf)[: d.total_bytes]

    def publish(self, d: Descriptor, tags: Any = None) -> None:
        self._held = d

    def discard(self, d: Descriptor, reason: str) -> None:
        pass

    def held(self, job: str, owner_rank: int) -> Descriptor | None:
        return self._held

    def lookup(self, job: str, owner_rank: int,
               version: Version | None) -> tuple[Descriptor, memoryview] | None:
        return None


def recv_exactly(sock: socket.socket, view: memoryview, feed=None) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("sender closed early")
        if feed is not None:  # as the transport does: each piece while it is in cache
            feed(view[got : got + n])
        got += n


# -- receivers (child process) -----------------------------------------------------------------


def raw_receiver(conn, size: int, chunk: int, repeat: int, check: str) -> None:
    buf = memoryview(touched(size))
    digest = bytearray(16 if check in KEYS else 8)
    key = KEYS.get(check, FrameKey)(MAC_KEY)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        sock, _ = listener.accept()
        channel.tune(sock)  # the same socket options as the product's, for a like-for-like ceiling
        with sock:
            for _ in range(repeat):  # one connection, as the transport keeps its own
                cpu = time.process_time()
                for off in range(0, size, chunk):
                    part = buf[off : off + chunk]
                    if check:
                        recv_exactly(sock, memoryview(digest))
                    if check in KEYS:
                        opener = key.opener(bytes(digest))
                        recv_exactly(sock, part, opener.update)
                        if not opener.verify():
                            raise ValueError("chunk tag mismatch")
                        continue
                    recv_exactly(sock, part)
                    if check and xxhash.xxh3_64_intdigest(part) != struct.unpack("!Q", digest)[0]:
                        raise ValueError("chunk checksum mismatch")
                sock.sendall(b"k")
                cpu = time.process_time() - cpu
                conn.send((cpu, xxhash.xxh3_64_intdigest(buf)))


def elasticd_receiver(conn, size: int, chunk: int) -> None:
    sink = PreallocatedSink(size + len(HEADER))
    server = ReplicaServer("127.0.0.1", 0, SECRET, "receiver", sink, max_frame=chunk + 64,
                           chunk_size=chunk).start()
    conn.send(server.address[1])
    checking = 0.0  # CPU spent on the bench's own check, kept out of the figures
    while conn.recv() != "stop":  # a probe: report what arrived and the CPU used so far
        before = time.process_time()
        digest = xxhash.xxh3_64_intdigest(memoryview(sink.buf)[len(HEADER) :])
        checking += time.process_time() - before
        conn.send((time.process_time() - checking, digest))
    server.stop()


# -- senders (this process) --------------------------------------------------------------------


class RawSender:
    """One connection to a raw receiver; ``check`` ("", "xxh3", "mac" or "gmac") adds a checksum or
    tag per chunk, made by the sender and checked by the receiver."""

    def __init__(self, payload: memoryview, chunk: int, repeat: int, check: str) -> None:
        self.payload, self.chunk, self.check = payload, chunk, check
        self.key = KEYS.get(check, FrameKey)(MAC_KEY)
        self.pipe, child = mp.Pipe()
        self.proc = mp.get_context("fork").Process(
            target=raw_receiver, args=(child, len(payload), chunk, repeat, check), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", self.pipe.recv()))
        channel.tune(self.sock)

    def transfer(self) -> tuple[float, float, float, int]:
        cpu = time.process_time()
        start = time.perf_counter()
        for off in range(0, len(self.payload), self.chunk):
            part = self.payload[off : off + self.chunk]
            if self.check in KEYS:
                self.sock.sendall(self.key.seal(part))
            elif self.check:
                self.sock.sendall(struct.pack("!Q", xxhash.xxh3_64_intdigest(part)))
            self.sock.sendall(part)
        if self.sock.recv(1) != b"k":
            raise ConnectionError("no acknowledgement")
        seconds = time.perf_counter() - start
        sender_cpu = time.process_time() - cpu
        receiver_cpu, digest = self.pipe.recv()
        return seconds, sender_cpu, receiver_cpu, digest

    def close(self) -> None:
        self.sock.close()
        self.proc.join(10)


class ElasticdSender:
    """A ReplicaClient pushing successive steps to a ReplicaServer in the child."""

    def __init__(self, payload: memoryview, chunk: int, pretag: bool = False) -> None:
        self.payload, self.chunk, self.step = payload, chunk, 0
        self.pretag = pretag
        #: CPU seconds each transfer's block tags took to make (the seal's share, off the push).
        self.tag_cpu: list[float] = []
        self.pipe, child = mp.Pipe()
        self.proc = mp.get_context("fork").Process(
            target=elasticd_receiver, args=(child, len(payload), chunk), daemon=True)
        self.proc.start()
        port = self.pipe.recv()
        self.client = ReplicaClient.connect("127.0.0.1", port, SECRET, "sender",
                                            max_frame=chunk + 64)
        self.receiver_cpu = self._probe()[0]

    def _probe(self) -> tuple[float, int]:
        self.pipe.send("probe")
        return self.pipe.recv()

    def transfer(self) -> tuple[float, float, float, int]:
        self.step += 1
        d = Descriptor("bench", 0, 0, self.step, len(HEADER) + len(self.payload),
                       len(HEADER))
        tags = None
        if self.pretag:
            # What the daemon does once per snapshot when it seals it (SlotStore.tagger):
            # timed apart, as it is not on the push's path.
            cpu = time.process_time()
            size, base = len(self.payload), len(HEADER)
            tags = BlockTagger(SECRET).tag(
                self.payload, [(base + a, base + min(a + self.chunk, size))
                               for a in range(0, size, self.chunk)], base=base)
            self.tag_cpu.append(time.process_time() - cpu)
        cpu = time.process_time()
        start = time.perf_counter()
        self.client.push(d, HEADER, self.payload, chunk_size=self.chunk, tags=tags)
        seconds = time.perf_counter() - start
        sender_cpu = time.process_time() - cpu
        receiver_cpu, digest = self._probe()
        used, self.receiver_cpu = receiver_cpu - self.receiver_cpu, receiver_cpu
        return seconds, sender_cpu, used, digest

    def close(self) -> None:
        self.client.close()
        self.pipe.send("stop")
        self.proc.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB per transfer")
    parser.add_argument("--chunk-mib", type=int, default=4, help="chunk size in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="transfers per variant (median)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--primitives", action="store_true",
                        help="only time the candidate frame authenticators on one core")
    args = parser.parse_args()
    if args.primitives:
        primitives(args.chunk_mib << 20)
        return
    size, chunk = args.mib << 20, args.chunk_mib << 20

    source = touched(size)
    for i in range(0, size, 1 << 20):  # non-trivial bytes, so checksums mean something
        source[i : i + 8] = struct.pack("!Q", i * 2654435761 % 2**64)
    payload = memoryview(source)
    expected = xxhash.xxh3_64_intdigest(payload)

    senders = {
        "raw socket": RawSender(payload, chunk, args.repeat, check=""),
        "raw + xxh3 per chunk": RawSender(payload, chunk, args.repeat, check="xxh3"),
        "raw + Poly1305 per chunk": RawSender(payload, chunk, args.repeat, check="mac"),
        "raw + GMAC per chunk (v2)": RawSender(payload, chunk, args.repeat, check="gmac"),
        "elasticd push, tagged inline": ElasticdSender(payload, chunk),
        "elasticd push": ElasticdSender(payload, chunk, pretag=True),
    }
    results: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in senders}
    try:
        # Interleaved, so that noise from other work on the machine hits every variant alike.
        for _ in range(args.repeat):
            for name, sender in senders.items():
                results[name].append(sender.transfer())
    finally:
        for sender in senders.values():
            sender.close()
    mac_alone = mac_rate(payload[:chunk])

    gib = size / 2**30
    print(f"loopback, {args.mib} MiB per transfer, {args.chunk_mib} MiB chunks, "
          f"median of {args.repeat} (interleaved)")
    print(f"{'variant':<27} {'GB/s':>7} {'vs raw':>7} {'CPU s/GiB':>10} {'sender':>7} "
          f"{'receiver':>8}  intact")
    base = None
    figures = {}
    for name, rows in results.items():
        seconds = statistics.median(r[0] for r in rows)
        send_cpu = statistics.median(r[1] for r in rows) / gib
        recv_cpu = statistics.median(r[2] for r in rows) / gib
        cpu = statistics.median(r[1] + r[2] for r in rows) / gib
        intact = all(r[3] == expected for r in rows)
        rate = size / seconds / 1e9
        base = base or rate
        print(f"{name:<27} {rate:>7.2f} {rate / base:>7.0%} {cpu:>10.2f} {send_cpu:>7.2f} "
              f"{recv_cpu:>8.2f}  {intact}")
        figures[name] = {"seconds": seconds, "gb_per_s": rate, "cpu_seconds_per_gib": cpu,
                         "sender_cpu_seconds_per_gib": send_cpu,
                         "receiver_cpu_seconds_per_gib": recv_cpu, "intact": intact}
    print(f"Poly1305 pass alone, one core, {args.chunk_mib} MiB buffer: {mac_alone:.2f} GB/s "
          f"({1 / mac_alone / 1.073741824:.2f} CPU s/GiB per side)")
    seal_tags = statistics.median(senders["elasticd push"].tag_cpu) / gib
    print(f"block tags made at seal time (once per snapshot, off the push): {seal_tags:.2f} "
          "CPU s/GiB")
    ratio = figures["elasticd push"]["gb_per_s"] / figures["raw socket"]["gb_per_s"]
    print(f"elasticd push (every frame authenticated) / raw socket: {ratio:.2f} "
          f"(target >= 0.80: {'met' if ratio >= 0.8 else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": size, "chunk_bytes": chunk, "repeat": args.repeat,
                       "variants": figures, "mac_one_core_gb_per_s": mac_alone,
                       "push_vs_raw": ratio,
                       "seal_block_tags_cpu_seconds_per_gib": seal_tags}, f, indent=1)


def primitives(size: int) -> None:
    """GB/s (CPU time, one core) of each candidate authenticator over one ``size`` buffer."""
    import hashlib
    import hmac

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    buf = memoryview(touched(size))
    key, nonce, out = bytes(range(32)), bytes(12), {}

    def gmac() -> bytes:  # protocol v2's frame tag: AES-GCM, the frame as associated data
        encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(buf)
        encryptor.finalize()
        return encryptor.tag

    candidates = {
        "HMAC-SHA256": lambda: hmac.new(key, buf, "sha256").digest(),
        "keyed BLAKE2b": lambda: hashlib.blake2b(buf, key=key).digest(),
        "AES-GCM (encrypting, new output buffer)": lambda: AESGCM(key).encrypt(nonce, buf, None),
        "AES-GMAC (AESGCM, empty plaintext)": lambda: AESGCM(key).encrypt(nonce, b"", buf),
        "AES-GMAC (protocol v2's frame tag)": gmac,
        "ChaCha20-Poly1305 (AEAD, empty plaintext)":
            lambda: ChaCha20Poly1305(key).encrypt(nonce, b"", buf),
        "Poly1305 (one-shot)": lambda: Poly1305.generate_tag(key, buf),
        "ChaCha20-Poly1305 (as the transport seals)": lambda: FrameKey(key).seal(buf),
        "xxh3_64 (unkeyed, for scale)": lambda: xxhash.xxh3_64_intdigest(buf),
    }
    for name, fn in candidates.items():
        done, start = 0, time.process_time()
        while time.process_time() - start < 0.5:
            fn()
            done += size
        out[name] = done / (time.process_time() - start) / 1e9
        print(f"{name:<44} {out[name]:6.2f} GB/s")


def mac_rate(buf: memoryview, seconds: float = 0.5) -> float:
    """GB/s of the tag pass alone on this thread (CPU time), as the transport runs it."""
    key = FrameKey(MAC_KEY)
    done, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        key.seal(buf)
        done += len(buf)
    return done / (time.process_time() - start) / 1e9


if __name__ == "__main__":
    main()

"""Cost of the worker ↔ daemon local channel: ``DaemonClient.call`` round trip and
``DaemonClient.send`` (one-way progress report), µs per op, median over N.

Baseline, measured in the same run: the same frames over a bare Unix socket to a minimal
Python server that answers every request with a fixed frame (no JSON, no dispatch, no
credentials) — the floor the channel's own work sits on. Servers run in separate processes,
as the daemon does.

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/bench_local_api.py --ops 10000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

from elasticd.worker import DaemonClient, WorkerIdentity

LEN = struct.Struct("!I")
BATCH = 100  # one-way sends between flushes, so the daemon never falls behind and drops


def serve(path: str, kind: str) -> None:
    """Server process: the real LocalServer, or the bare baseline."""
    if kind == "local_api":
        from elasticd.daemon.local_api import LocalServer
        steps = []
        server = LocalServer(path, {"ping": lambda m: {}, "progress": lambda m: steps.append(
            m["step"])})
        server.start()
        print("ready", flush=True)
        sys.stdin.read()
        server.stop()
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    print("ready", flush=True)
    conn, _ = listener.accept()
    reply = LEN.pack(19) + b'{"id":1,"ok":true} '
    buf = b""
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + LEN.unpack_from(buf)[0]:
            end = 4 + LEN.unpack_from(buf)[0]
            if b'"noreply"' not in buf[4:end]:
                conn.sendall(reply)
            buf = buf[end:]
    conn.close()
    listener.close()
    os.unlink(path)


def start_server(path: str, kind: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", path, kind],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def timed(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn(i)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def summary(samples: list[float]) -> dict:
    samples = sorted(samples)
    return {"median_us": round(statistics.median(samples), 2),
            "p99_us": round(samples[int(len(samples) * 0.99)], 2), "ops": len(samples)}


def bench_local_api(path: str, ops: int) -> dict:
    proc = start_server(path, "local_api")
    try:
        client = DaemonClient(path, WorkerIdentity(job="bench", rank=0, local_rank=0))
        for i in range(1000):  # warm up
            client.call("ping")
        call = timed(lambda i: client.call("ping"), ops)
        send: list[float] = []
        for b in range(ops // BATCH):
            send += timed(lambda i: client.progress(b * BATCH + i), BATCH)
            client.call("ping")  # the daemon has handled every progress report before this
        assert client.dropped == 0, f"{client.dropped} reports dropped"
        client.close()
        return {"call": summary(call), "send": summary(send)}
    finally:
        proc.stdin.close()
        proc.wait(10)


def bench_bare(path: str, ops: int) -> dict:
    proc = start_server(path, "bare")
    request = LEN.pack(24) + b'{"op":"ping","id":12345}'
    progress = json.dumps({"step": 123456, "rank": 0, "local_rank": 0, "pid": os.getpid(),
                           "job": "bench", "op": "progress", "noreply": True},
                          separators=(",", ":")).encode()
    progress = LEN.pack(len(progress)) + progress
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)

        def round_trip(_i: int) -> None:
            sock.sendall(request)
            sock.recv(64)

        for i in range(1000):
            round_trip(i)
        call = timed(round_trip, ops)
        send: list[float] = []
        for _ in range(ops // BATCH):
            send += timed(lambda i: sock.send(progress, socket.MSG_DONTWAIT), BATCH)
            round_trip(0)
        sock.close()
        return {"call": summary(call), "send": summary(send)}
    finally:
        proc.stdin.close()
        proc.wait(10)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ops", type=int, default=10_000)
    p.add_argument("--out", default="bench/results/local_api.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ed-bench-") as d:
        ours = bench_local_api(os.path.join(d, "d.sock"), args.ops)
        bare = bench_bare(os.path.join(d, "bare.sock"), args.ops)
    result = {
        "benchmark": "local_api",
        "command": "bench/bench_local_api.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "local_api": ours,
        "baseline": {"name": "same frames, bare Unix socket, minimal Python server", **bare},
    }
    print(f"{'op':<28}{'median µs':>10}{'p99 µs':>10}")
    for name, figures in (("call (round trip)", ours["call"]), ("  baseline", bare["call"]),
                          ("send (progress, one-way)", ours["send"]),
                          ("  baseline", bare["send"])):
        print(f"{name:<28}{figures['median_us']:>10.1f}{figures['p99_us']:>10.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A cluster of elasticd daemons on this one host, for trying your own script: ``up`` starts an
etcd and N daemons with replication on, ``kill`` and ``start`` take a node away (as a machine
failure does: kill -9 of everything it runs, its RAM gone) and bring it back, ``down`` stops it
all. Jobs are submitted with ``elasticctl`` (``env`` prints what to export for it).

What a second daemon on one host needs, and ``up`` handles: its own HTTP and replication ports
(``elasticd``'s defaults, ``127.0.0.1:9400`` and ``0.0.0.0:9401``, collide; here every port is
picked by the kernel and bound to 127.0.0.1), one cluster secret shared by all (without one,
replication is off), its own state directory and its own shared-memory directory (its "RAM",
which ``kill`` deletes). With ``--gpus``, each daemon gets its own ``CUDA_VISIBLE_DEVICES``,
which its jobs' workers inherit (a GPU set per node).

``up`` returns once every node has joined; a process of its own (``up --foreground``, started
in a session of its own) holds the cluster, and the other commands ask it over a Unix socket in
the cluster's directory, which only its owner may use. Built on :mod:`elasticd.launcher`, as the
demo and the tests are.

    python -m elasticd.onehost up --nodes 3
    eval "$(python -m elasticd.onehost env)"
    elasticctl submit ...
    python -m elasticd.onehost kill n2
    python -m elasticd.onehost start n2
    python -m elasticd.onehost down
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any

from elasticd.agent.supervisor import process_runs
from elasticd.clock import SYSTEM_CLOCK
from elasticd.errors import InputError
from elasticd.launcher import JOB_USER, LocalCluster
from elasticd.local.worker_link import peer_credentials

PROG = "python -m elasticd.onehost"
STATE = "onehost.json"
SOCKET = "onehost.sock"
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class OneHostError(InputError):
    """A command that cannot be done: one line, exit 1."""


def default_dir() -> str:
    """Where the cluster lives unless ``--dir`` says otherwise (honours ``TMPDIR``)."""
    return os.path.join(tempfile.gettempdir(), f"elasticd-onehost-{os.getuid()}")


def gpu_sets(spec: str, nodes: int) -> list[str]:
    """``--gpus 0,1:2,3`` -> one ``CUDA_VISIBLE_DEVICES`` per node (``:`` between nodes)."""
    sets = spec.split(":")
    if len(sets) != nodes or not all(re.fullmatch(r"\d+(,\d+)*", s) for s in sets):
        raise OneHostError(f"--gpus {spec!r}: give one comma-separated set of GPU numbers per "
                           f"node, the sets separated by ':' ({nodes} nodes: e.g. "
                           f"{':'.join(f'{2 * i},{2 * i + 1}' for i in range(nodes))})")
    return sets


# -- the process that holds the cluster ----------------------------------------------------------

class Holder:
    """Runs the cluster and answers the other commands (``up --foreground``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.dir = args.dir
        names = [f"n{i}" for i in range(1, args.nodes + 1)]
        gpus = gpu_sets(args.gpus, args.nodes) if args.gpus else []
        self.cluster = LocalCluster(
            names, workdir=self.dir, lease_ttl=args.lease_ttl, replication=True,
            extra_args=["--replicas", str(args.replicas)], shm_prefix="elasticd-onehost-",
            node_env={n: {"CUDA_VISIBLE_DEVICES": g} for n, g in zip(names, gpus)})
        self.lock = threading.Lock()
        self.done = threading.Event()

    def run(self) -> int:
        path = os.path.join(self.dir, SOCKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        os.chmod(path, 0o600)
        server.listen(8)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.done.set())
        try:
            self.cluster.start(timeout=60)
            self._write_state()
            threading.Thread(target=self._serve, args=(server,), daemon=True).start()
            print(f"up: {self.describe()}", flush=True)
            while not self.done.wait(0.5):
                pass
            return 0
        finally:
            server.close()
            with self.lock:
                self.cluster.stop()
            for name in (SOCKET, STATE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.dir, name))
            print("down: every daemon, job and etcd stopped", flush=True)

    def describe(self) -> str:
        live = [n for n, p in self.cluster.nodes.items() if p.running]
        return (f"etcd {self.cluster.etcd}, prefix {self.cluster.prefix}, nodes "
                f"{' '.join(live) or 'none'} (replication on, lease TTL "
                f"{self.cluster.lease_ttl} s)")

    def _write_state(self) -> None:
        c = self.cluster
        state = {"pid": os.getpid(), "etcd": c.etcd, "prefix": c.prefix, "job_user": JOB_USER,
                 "python_bin": os.path.dirname(sys.executable),
                 "nodes": {n: {"running": p.running, "pid": p.pid if p.proc else None,
                               "address": p.address, "log": p.log_path,
                               "argv": [a for a in p.argv]}
                           for n, p in c.nodes.items()}}
        tmp = os.path.join(self.dir, STATE + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(state, fh, indent=1)
        os.replace(tmp, os.path.join(self.dir, STATE))

    def _serve(self, server: socket.socket) -> None:
        while not self.done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                _, uid, _ = peer_credentials(conn)  # the kernel's word
                if uid != os.getuid():  # the socket is 0600; this is the second lock
                    continue
                try:
                    req = json.loads(conn.makefile().readline())
                    reply = {"ok": True, "detail": self._do(req)}
                except OneHostError as exc:
                    reply = {"ok": False, "detail": str(exc)}
                except Exception as exc:  # a bug: still one line back
                    reply = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"}
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps(reply).encode() + b"\n")

    def _do(self, req: dict[str, Any]) -> str:
        op, node = req.get("op"), req.get("node")
        if op == "down":
            self.done.set()
            return "stopping"
        if op == "status":
            return self.describe()
        if op not in ("kill", "start") or not isinstance(node, str) or not NODE_RE.match(node):
            raise OneHostError(f"bad request {req!r}")
        with self.lock:
            nodes = self.cluster.nodes
            if op == "kill":
                if node not in nodes or not nodes[node].running:
                    raise OneHostError(f"{node} is not running (running: "
                                       f"{' '.join(n for n, p in nodes.items() if p.running)})")
                nodes[node].kill()
                detail = (f"killed {node}: kill -9 of its daemon, agent and workers, and its "
                          f"RAM (snapshots and the copies it held for its peers) deleted")
            else:
                if node in nodes and nodes[node].running:
                    raise OneHostError(f"{node} is already running")
                added = node not in nodes
                self.cluster.start_node(node, timeout=60)
                detail = (f"started {node}{' (a new node)' if added else ''}: it joined the "
                          f"cluster with empty RAM; a job it can run takes it in")
            self._write_state()
            return detail


# -- the commands -------------------------------------------------------------------------------

def ask(directory: str, req: dict[str, Any], timeout: float = 90.0) -> str:
    """Sends one request to the holder of the cluster in ``directory``; returns its answer."""
    path = os.path.join(directory, SOCKET)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(json.dumps(req).encode() + b"\n")
            reply = json.loads(s.makefile().readline() or "{}")
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise OneHostError(f"no cluster is up in {directory} ({type(exc).__name__}): start one "
                           f"with `{PROG} up --nodes 3`") from None
    except (OSError, ValueError) as exc:
        raise OneHostError(f"the cluster in {directory} did not answer: {exc}") from None
    if not reply.get("ok"):
        raise OneHostError(reply.get("detail") or "no answer")
    return reply["detail"]


def read_state(directory: str) -> dict[str, Any]:
    try:
        with open(os.path.join(directory, STATE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        raise OneHostError(f"no cluster is up in {directory}: start one with "
                           f"`{PROG} up --nodes 3`") from None


def cmd_up(args: argparse.Namespace) -> int:
    if args.gpus:
        gpu_sets(args.gpus, args.nodes)  # a bad one fails here, not in the holder's log
    with contextlib.suppress(OneHostError):
        ask(args.dir, {"op": "status"}, timeout=5.0)
        raise OneHostError(f"a cluster is already up in {args.dir}: `{PROG} down` first, or "
                           f"give another --dir")
    os.makedirs(args.dir, mode=0o700, exist_ok=True)
    if args.foreground:
        return Holder(args).run()
    log_path = os.path.join(args.dir, "onehost.log")
    argv = [sys.executable, "-m", "elasticd.onehost", "up", "--foreground", "--dir", args.dir,
            "--nodes", str(args.nodes), "--lease-ttl", str(args.lease_ttl), "--replicas",
            str(args.replicas), *(["--gpus", args.gpus] if args.gpus else [])]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = SYSTEM_CLOCK.monotonic() + 120
    while SYSTEM_CLOCK.monotonic() < deadline:
        if proc.poll() is not None:
            tail = open(log_path, errors="replace").read().splitlines()[-10:]
            raise OneHostError(f"the cluster did not come up (exit {proc.returncode}); "
                               f"{log_path} ends: " + " | ".join(tail))
        with contextlib.suppress(OneHostError):
            print(f"up in {args.dir}: {ask(args.dir, {'op': 'status'}, timeout=5.0)}")
            me = f"{min(sys.executable, os.path.relpath(sys.executable), key=len)} -m " \
                 "elasticd.onehost"
            print(f"  next: eval \"$({me} env)\"  (then elasticctl talks to it)\n"
                  f"        elasticctl submit NAME --nnodes {min(2, args.nodes)}:{args.nodes} "
                  "--nproc-per-node 1"
                  f"{' --user ' + JOB_USER if os.geteuid() == 0 else ''} -- SCRIPT ARGS\n"
                  f"        {me} kill n2  |  {me} start n2  |  {me} down\n"
                  f"  logs: {args.dir}/<node>.log (daemons), "
                  f"{args.dir}/<node>/jobs/<job>/agent.log (workers)")
            return 0
        SYSTEM_CLOCK.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    raise OneHostError(f"the cluster did not come up within 120 s; see {log_path}")


def cmd_env(args: argparse.Namespace) -> int:
    state = read_state(args.dir)
    print(f"export ELASTICD_ETCD={shlex.quote(state['etcd'])} "
          f"ELASTICD_PREFIX={shlex.quote(state['prefix'])} "
          f"PATH={shlex.quote(state['python_bin'])}:\"$PATH\"")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    print(ask(args.dir, {"op": args.command, "node": args.node}))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    pid = read_state(args.dir)["pid"]
    ask(args.dir, {"op": "down"})
    deadline = SYSTEM_CLOCK.monotonic() + 120
    # A zombie has exited: its parent (an earlier `up`) is gone and will not reap it.
    while process_runs(pid) and SYSTEM_CLOCK.monotonic() < deadline:
        SYSTEM_CLOCK.sleep(0.2)
    print(f"down: the cluster in {args.dir} is stopped (its logs stay there)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default=default_dir(),
                        help="the cluster's directory: logs, state, control socket "
                             "(default: %(default)s)")
    up = sub.add_parser("up", parents=[common], help="start etcd and N daemons")
    up.add_argument("--nodes", type=int, default=3, choices=range(1, 17), metavar="N")
    up.add_argument("--lease-ttl", type=int, default=2, help="seconds (default 2)")
    up.add_argument("--replicas", type=int, default=2,
                    help="copies of each snapshot: its own and m-1 peers' (default 2)")
    up.add_argument("--gpus", default="", metavar="SETS",
                    help="a GPU set per node: CUDA_VISIBLE_DEVICES of each, e.g. 0,1:2,3")
    up.add_argument("--foreground", action="store_true",
                    help="hold the cluster in this process until SIGTERM or `down`")
    sub.add_parser("env", parents=[common], help="shell exports for elasticctl")
    for name, what in (("kill", "kill -9 a node and its RAM"),
                       ("start", "start a node again (or a new one)")):
        s = sub.add_parser(name, parents=[common], help=what)
        s.add_argument("node")
    sub.add_parser("down", parents=[common], help="stop every daemon, job and etcd")
    return p


COMMANDS = {"up": cmd_up, "env": cmd_env, "kill": cmd_node, "start": cmd_node,
            "down": cmd_down}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.dir = os.path.abspath(args.dir)
    try:
        return COMMANDS[args.command](args)
    except OneHostError as exc:
        print(f"{PROG.split()[-1]}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

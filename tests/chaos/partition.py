"""Network partitions on one host: every packet a group of processes sends or receives dropped.

All simulated nodes share the loopback interface, so a partition cannot cut a cable. It cuts
the processes instead: the node's processes live in a cgroup (v2) of their own from birth, and
a two-instruction eBPF program (``r0 = 0; exit``: drop) is attached to that cgroup for inet
ingress and egress. Every TCP/UDP packet to or from any socket of those processes is dropped —
etcd, peers, replication, gloo — while Unix sockets (the daemon's local API) keep working, as
they would on a partitioned machine. Healing detaches the program.

A port alone can be cut as well (:meth:`Partition.cut` with ``port``): the program then drops
only the packets of the cgroup's sockets bound locally to that port (a node's replication
server: its listening socket and every connection it accepted), both ways, and lets everything
else through (etcd, the lease, rendezvous, its own outgoing connections). It counts the bytes of
that port in a one-entry BPF array, and with ``after_bytes`` it lets that many through before it
drops anything: the hole opens in the middle of a transfer, decided in the kernel at packet
granularity, however fast the transfer runs. :meth:`Partition.port_bytes` reads the count.

Needs root (CAP_SYS_ADMIN / CAP_BPF) and a cgroup v2 hierarchy; :func:`available` says whether
this machine has them. No nftables or iptables required (the CI machine has neither).
"""

from __future__ import annotations

import ctypes
import os
import struct
import uuid

_SYS_BPF = 321  # x86_64
_BPF_MAP_CREATE, _BPF_MAP_LOOKUP_ELEM, _BPF_MAP_UPDATE_ELEM = 0, 1, 2
_BPF_PROG_LOAD, _BPF_PROG_ATTACH, _BPF_PROG_DETACH = 5, 8, 9
_BPF_MAP_TYPE_ARRAY = 2
_BPF_PSEUDO_MAP_FD = 1
_BPF_FUNC_MAP_LOOKUP_ELEM = 1
#: Offsets in ``struct __sk_buff`` (linux/bpf.h): len; local_port (host byte order).
_SKB_LEN, _SKB_LOCAL_PORT = 0, 136
#: Packets shorter than this (bytes, IP header included) are not counted: pure ACKs.
_MIN_COUNTED = 256
_BPF_PROG_TYPE_CGROUP_SKB = 8
_BPF_CGROUP_INET_INGRESS, _BPF_CGROUP_INET_EGRESS = 0, 1
_KINDS = (_BPF_CGROUP_INET_EGRESS, _BPF_CGROUP_INET_INGRESS)
# r0 = 0 (BPF_ALU64 | BPF_MOV | BPF_K); exit (BPF_JMP | BPF_EXIT): "drop this packet".
_DROP = struct.pack("<BBhi", 0xB7, 0, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class PartitionError(RuntimeError):
    """The partition could not be set up (no cgroup v2, no BPF permission, ...)."""


def _cgroup2_root() -> str | None:
    with open("/proc/self/mounts") as fh:
        for line in fh:
            _, mountpoint, fstype, *_ = line.split()
            if fstype == "cgroup2":
                return mountpoint
    return None


def _bpf(cmd: int, attr: bytes) -> int:
    buf = ctypes.create_string_buffer(attr, 128)
    ret = _libc.syscall(_SYS_BPF, cmd, buf, 128)
    if ret < 0:
        err = ctypes.get_errno()
        raise PartitionError(f"bpf({cmd}) failed: {os.strerror(err)}")
    return ret


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | (src << 4), off, imm)


def _port_program(port: int, map_fd: int, count: bool) -> bytes:
    """``struct __sk_buff *skb`` in r1. For a packet of a socket bound locally to ``port``: add
    its length to the map's count (value bytes 0-7) when ``count``, then drop it when a limit
    is set (bytes 8-15, 0: none) and the count has reached it. Every other packet passes."""
    allow = [
        _insn(0xB7, dst=0, imm=1),  # r0 = 1 (pass)
        _insn(0x95),  # exit
    ]
    body = [
        _insn(0xBF, dst=6, src=1),  # r6 = skb
        _insn(0x61, dst=2, src=6, off=_SKB_LOCAL_PORT),  # r2 = skb->local_port
        None,  # if r2 != port goto allow (patched below)
        _insn(0x18, dst=1, src=_BPF_PSEUDO_MAP_FD, imm=map_fd),  # r1 = the map (ld_imm64,
        _insn(0x00),  # second half)
        _insn(0xBF, dst=2, src=10),  # r2 = fp
        _insn(0x07, dst=2, imm=-4),  # r2 -= 4: the key's address
        _insn(0x62, dst=10, off=-4, imm=0),  # key = 0
        _insn(0x85, imm=_BPF_FUNC_MAP_LOOKUP_ELEM),  # r0 = &value or NULL
        None,  # if r0 == 0 goto allow (patched below)
        _insn(0x61, dst=1, src=6, off=_SKB_LEN),  # r1 = skb->len
        # Counting: if r1 >= _MIN_COUNTED, lock *(u64 *)(r0 + 0) += r1. (Pure ACKs and
        # control frames are not counted: only bytes a transfer sends open the hole.)
        _insn(0xA5, dst=1, off=1, imm=_MIN_COUNTED) if count else _insn(0x05, off=0),
        _insn(0xDB, dst=0, src=1, off=0, imm=0) if count else _insn(0x05, off=0),
        _insn(0x79, dst=1, src=0, off=0),  # r1 = count
        _insn(0x79, dst=2, src=0, off=8),  # r2 = limit
        None,  # if r2 == 0 goto allow
        None,  # if r1 < r2 goto allow (unsigned)
        _insn(0xB7, dst=0, imm=0),  # r0 = 0 (drop)
        _insn(0x95),  # exit
    ]
    to_allow = lambda i: len(body) - i - 1  # noqa: E731 — jump offset from insn i to ``allow``
    body[2] = _insn(0x55, dst=2, off=to_allow(2), imm=port)
    body[9] = _insn(0x15, dst=0, off=to_allow(9), imm=0)
    body[15] = _insn(0x15, dst=2, off=to_allow(15), imm=0)
    body[16] = _insn(0xAD, dst=1, src=2, off=to_allow(16))
    return b"".join(body + allow)


def _load_drop_program(code: bytes = _DROP) -> int:
    insns = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(b"GPL")
    # union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level,
    # log_size, log_buf, kern_version (the rest zero).
    attr = struct.pack("<IIQQIIQI", _BPF_PROG_TYPE_CGROUP_SKB, len(code) // 8,
                       ctypes.addressof(insns), ctypes.addressof(license_), 0, 0, 0, 0)
    return _bpf(_BPF_PROG_LOAD, attr)


def _create_counter_map() -> int:
    """A BPF array of one entry of 16 bytes: (count, limit), both u64, zeroed."""
    return _bpf(_BPF_MAP_CREATE, struct.pack("<IIIII", _BPF_MAP_TYPE_ARRAY, 4, 16, 1, 0))


def _map_value(map_fd: int, value: bytes | None = None) -> bytes:
    """Reads (or, with ``value``, writes) the counter map's one entry."""
    key = ctypes.create_string_buffer(struct.pack("<I", 0), 4)
    buf = ctypes.create_string_buffer(value or b"", 16)
    cmd = _BPF_MAP_LOOKUP_ELEM if value is None else _BPF_MAP_UPDATE_ELEM
    _bpf(cmd, struct.pack("<IIQQQ", map_fd, 0, ctypes.addressof(key), ctypes.addressof(buf), 0))
    return buf.raw


class Partition:
    """A node's cgroup: its processes go in when they start, and :meth:`cut` drops every packet
    of theirs until :meth:`heal`.

    The drop program acts on the cgroup a *socket* was created in, so the node's processes must
    be in the cgroup before they open any (a process moved later keeps its old sockets
    working): the harness adds each daemon right after it is started, and the daemon's agent
    and workers inherit the cgroup.
    """

    def __init__(self, name: str = "") -> None:
        root = _cgroup2_root()
        if root is None:
            raise PartitionError("no cgroup v2 hierarchy mounted")
        self.path = os.path.join(root, f"elasticd-chaos-{name or 'node'}-{uuid.uuid4().hex[:6]}")
        os.mkdir(self.path)
        self._progs: dict[int, int] = {}  # attach type -> program fd
        self._cg = -1
        self._map = -1

    def add(self, pid: int) -> None:
        try:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as fh:
                fh.write(str(pid))
        except ProcessLookupError:
            pass

    def cut(self, port: int = 0, after_bytes: int = 0, count_only: bool = False) -> None:
        """Drops every inet packet of the cgroup's sockets, both ways; with ``port``, only
        those of its sockets bound locally to that port.

        Args:
            port: cut this local port alone (0: everything).
            after_bytes: with a port, the bytes the port sends (IP packets of 256 bytes or
                more: a transfer's, not pure ACKs) let through before the first drop.
            count_only: with a port, drop nothing: only count what it sends
                (:meth:`port_bytes`) until :meth:`close_port`.
        """
        if self._progs:
            raise PartitionError(f"{self.path} is already cut")
        if not 0 <= port < 65536 or after_bytes < 0:
            raise ValueError(f"cut needs a port in [0, 65536) and after_bytes >= 0, got "
                             f"{port}, {after_bytes}")
        try:
            self._cg = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            if not port:
                self._progs = {kind: _load_drop_program() for kind in _KINDS}
            else:
                # Counted on egress only: what the port *sends* (a fetch served, not a push
                # received) opens the hole; both directions are dropped once it is open.
                self._map = _create_counter_map()
                count, limit = (0, 0) if count_only else (0, after_bytes) if after_bytes else (1, 1)
                _map_value(self._map, struct.pack("<QQ", count, limit))
                self._progs = {kind: _load_drop_program(_port_program(
                    port, self._map, count=kind == _BPF_CGROUP_INET_EGRESS)) for kind in _KINDS}
            for kind, prog in self._progs.items():
                _bpf(_BPF_PROG_ATTACH, struct.pack("<IIII", self._cg, prog, kind, 0))
        except BaseException:
            self.heal()
            raise

    def heal(self) -> None:
        """Detaches the drop program (traffic flows again)."""
        if self._cg >= 0:
            for kind, prog in self._progs.items():
                try:
                    _bpf(_BPF_PROG_DETACH, struct.pack("<IIII", self._cg, prog, kind, 0))
                except PartitionError:
                    pass
        for fd in (*self._progs.values(), self._cg, self._map):
            if fd >= 0:
                os.close(fd)
        self._progs = {}
        self._cg = self._map = -1

    def port_bytes(self) -> int:
        """Bytes of the cut port's packets seen so far (passed or dropped)."""
        if self._map < 0:
            raise PartitionError(f"{self.path} has no port cut")
        return struct.unpack("<QQ", _map_value(self._map))[0]

    def close_port(self) -> None:
        """Drops every packet of the cut port from now on, whatever was counted."""
        if self._map < 0:
            raise PartitionError(f"{self.path} has no port cut")
        _map_value(self._map, struct.pack("<QQ", self.port_bytes(), 1))

    def remove(self) -> bool:
        """Heals, moves whatever is left to the parent cgroup and removes this one."""
        self.heal()
        if not os.path.isdir(self.path):
            return True
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as fh:
                pids = fh.read().split()
            parent = os.path.join(os.path.dirname(self.path), "cgroup.procs")
            for pid in pids:
                try:
                    with open(parent, "w") as fh:
                        fh.write(pid)
                except OSError:
                    pass
            os.rmdir(self.path)
            return True
        except OSError:
            return False


def available() -> str:
    """"" when partitions work here, else why not."""
    try:
        p = Partition("probe")
        try:
            p.cut()
        finally:
            p.remove()
    except (PartitionError, OSError) as exc:
        return str(exc)
    return ""

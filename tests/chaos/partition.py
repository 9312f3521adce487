"""Network partitions on one host: every packet a group of processes sends or receives dropped.

All simulated nodes share the loopback interface, so a partition cannot cut a cable. It cuts
the processes instead: the node's processes live in a cgroup (v2) of their own from birth, and
a two-instruction eBPF program (``r0 = 0; exit``: drop) is attached to that cgroup for inet
ingress and egress. Every TCP/UDP packet to or from any socket of those processes is dropped —
etcd, peers, replication, gloo — while Unix sockets (the daemon's local API) keep working, as
they would on a partitioned machine. Healing detaches the program.

Needs root (CAP_SYS_ADMIN / CAP_BPF) and a cgroup v2 hierarchy; :func:`available` says whether
this machine has them. No nftables or iptables required.
"""

from __future__ import annotations

import ctypes
import os
import struct
import uuid

_SYS_BPF = 321  # x86_64
_BPF_PROG_LOAD, _BPF_PROG_ATTACH, _BPF_PROG_DETACH = 5, 8, 9
_BPF_PROG_TYPE_CGROUP_SKB = 8
_BPF_CGROUP_INET_INGRESS, _BPF_CGROUP_INET_EGRESS = 0, 1
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


def _load_drop_program() -> int:
    insns = ctypes.create_string_buffer(_DROP, len(_DROP))
    license_ = ctypes.create_string_buffer(b"GPL")
    # union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level,
    # log_size, log_buf, kern_version (the rest zero).
    attr = struct.pack("<IIQQIIQI", _BPF_PROG_TYPE_CGROUP_SKB, len(_DROP) // 8,
                       ctypes.addressof(insns), ctypes.addressof(license_), 0, 0, 0, 0)
    return _bpf(_BPF_PROG_LOAD, attr)


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
        self._prog = -1
        self._cg = -1

    def add(self, pid: int) -> None:
        try:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as fh:
                fh.write(str(pid))
        except ProcessLookupError:
            pass

    def cut(self) -> None:
        """Drops every inet packet of the cgroup's sockets, both ways."""
        try:
            self._prog = _load_drop_program()
            self._cg = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            for kind in (_BPF_CGROUP_INET_EGRESS, _BPF_CGROUP_INET_INGRESS):
                _bpf(_BPF_PROG_ATTACH, struct.pack("<IIII", self._cg, self._prog, kind, 0))
        except BaseException:
            self.heal()
            raise

    def heal(self) -> None:
        """Detaches the drop program (traffic flows again)."""
        if self._cg >= 0 and self._prog >= 0:
            for kind in (_BPF_CGROUP_INET_EGRESS, _BPF_CGROUP_INET_INGRESS):
                try:
                    _bpf(_BPF_PROG_DETACH, struct.pack("<IIII", self._cg, self._prog, kind, 0))
                except PartitionError:
                    pass
        for fd in (self._prog, self._cg):
            if fd >= 0:
                os.close(fd)
        self._prog = self._cg = -1

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

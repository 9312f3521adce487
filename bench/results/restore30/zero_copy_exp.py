"""Would a restore that builds the worker's tensors on the received buffer (no second copy) cost
less CPU than today's copy out of it? Micro-experiment, one process, one thread, CPU seconds
(process_time) per 576 MiB (one new rank's rows in the sharded bench), 4 repeats each.

  anon copy        dst.copy_(src), both touched anonymous memory: a plain memcpy (reference)
  preadv           today's worker path (worker/slot_rows.py): preadv from the received file
                   straight into the touched destination
  map+populate     what building the tensors on the received file costs instead of the copy:
                   mmap MAP_SHARED read-write + MADV_POPULATE_WRITE (a writable mapping the
                   state then lives on; no copy), and its munmap (paid when the state goes)
  map+fault        the same mapping faulted in by a write per page (a first optimizer step)
  hot vm_writev    process_vm_writev of 576 MiB from an 8 MiB buffer in cache into touched
                   memory (a daemon writing checked rows straight into a worker's tensors)
  hot copy         memcpy of the same from an 8 MiB buffer in cache (reference for the above)

The file: on /dev/shm (4 KiB pages) and on a tmpfs this script mounts with huge=within_size
(2 MiB pages, as bench_sharded_restore.py --huge-tmpfs), written with pwrite.
Run as root (the mount): python zero_copy_exp.py
"""
import ctypes
import mmap
import os
import subprocess
import sys
import tempfile
import time

import torch

torch.set_num_threads(1)
N = int(os.environ.get("R30_MIB", "576")) << 20
REPS = 4
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.POINTER(IOVec), ctypes.c_ulong,
                                   ctypes.POINTER(IOVec), ctypes.c_ulong, ctypes.c_ulong]
libc.process_vm_writev.restype = ctypes.c_ssize_t


def cpu(fn):
    c = time.process_time()
    fn()
    return round(time.process_time() - c, 3)


def file_modes(fd, dst):
    def pread():
        base = dst.data_ptr()
        for off in range(0, N, 64 << 20):
            n = min(64 << 20, N - off)
            assert os.preadv(fd, [(ctypes.c_char * n).from_address(base + off)], off) == n

    out = {"preadv": [], "map+populate": [], "munmap after populate": [], "map+fault": [],
           "munmap after fault": []}
    for _ in range(REPS):
        out["preadv"].append(cpu(pread))
        for how in ("populate", "fault"):
            box = {}

            def build():
                mm = mmap.mmap(fd, N, flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
                addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
                if how == "populate":
                    assert libc.madvise(addr, N, MADV_POPULATE_WRITE) == 0, ctypes.get_errno()
                else:
                    t = torch.frombuffer(mm, dtype=torch.uint8)
                    t[::PAGE] = 1
                    del t
                box["mm"] = mm

            out[f"map+{how}"].append(cpu(build))
            out[f"munmap after {how}"].append(cpu(lambda: box.pop("mm").close()))
    return out


def main():
    dst = torch.empty(N, dtype=torch.uint8)
    dst.fill_(1)
    src = torch.empty(N, dtype=torch.uint8)
    src.fill_(2)
    hot = torch.empty(8 << 20, dtype=torch.uint8)
    hot.fill_(3)
    res = {"anon copy": [], "hot copy": [], "hot vm_writev": []}

    def hot_copy():
        for off in range(0, N, hot.numel()):
            dst[off:off + hot.numel()].copy_(hot)

    def vm_writev():
        local = IOVec(hot.data_ptr(), hot.numel())
        for off in range(0, N, hot.numel()):
            remote = IOVec(dst.data_ptr() + off, hot.numel())
            assert libc.process_vm_writev(os.getpid(), ctypes.byref(local), 1,
                                          ctypes.byref(remote), 1, 0) == hot.numel()

    for _ in range(REPS):
        res["anon copy"].append(cpu(lambda: dst.copy_(src)))
        res["hot copy"].append(cpu(hot_copy))
        res["hot vm_writev"].append(cpu(vm_writev))
    print("memory:", res, flush=True)
    mnt = tempfile.mkdtemp(prefix="r30-huge-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=within_size,size=2G,mode=0700",
                    "tmpfs", mnt], check=True)
    try:
        for where in ("/dev/shm", mnt):
            path = os.path.join(where, f"r30-zero-copy-exp-{os.getpid()}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, N)
                chunk = os.urandom(8 << 20)
                for off in range(0, N, len(chunk)):
                    os.pwrite(fd, chunk, off)
                pages = "4 KiB (/dev/shm)" if where == "/dev/shm" else "2 MiB (huge=within_size)"
                print(f"file on {pages}:", file_modes(fd, dst), flush=True)
            finally:
                os.close(fd)
                os.unlink(path)
    finally:
        subprocess.run(["umount", mnt], check=True)
        os.rmdir(mnt)


if __name__ == "__main__":
    sys.exit(main())

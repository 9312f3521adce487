"""Worker-side copy out of a shm scratch: CPU of map + copy, per mapping mode (micro-experiment)."""
import mmap, os, time, ctypes, sys
import torch
torch.set_num_threads(1)
N = 576 << 20
path = f"/dev/shm/r28-copy-exp-{os.getpid()}"
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
try:
    os.ftruncate(fd, N)
    chunk = os.urandom(8 << 20)
    for off in range(0, N, len(chunk)):
        os.pwrite(fd, chunk, off)
    dst = torch.empty(N // 4, dtype=torch.float32); dst.fill_(1.0)
    anon = torch.empty(N // 4, dtype=torch.float32); anon.fill_(2.0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    def run(mode):
        t0, c0 = time.perf_counter(), time.process_time()
        if mode == "anon":
            dst.copy_(anon)
        else:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if mode == "populate" else 0)
            mm = mmap.mmap(fd, N, flags=flags, prot=mmap.PROT_READ)
            src = torch.frombuffer(mm, dtype=torch.float32)
            dst.copy_(src)
            del src
            mm.close()
        return time.perf_counter() - t0, time.process_time() - c0
    res = {m: [] for m in ("anon", "fault", "populate")}
    for _ in range(4):
        for m in res:
            res[m].append(run(m))
    for m, v in res.items():
        print(m, "wall", [round(a, 3) for a, _ in v], "cpu", [round(b, 3) for _, b in v])
finally:
    os.close(fd); os.unlink(path)

import mmap, os, time, ctypes
import torch
torch.set_num_threads(1)
N = 576 << 20
path = f"/dev/shm/r28-pread-exp-{os.getpid()}"
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
try:
    os.ftruncate(fd, N)
    chunk = os.urandom(8 << 20)
    for off in range(0, N, len(chunk)):
        os.pwrite(fd, chunk, off)
    dst = torch.empty(N // 4, dtype=torch.float32); dst.fill_(1.0)
    def run(mode):
        t0, c0 = time.perf_counter(), time.process_time()
        if mode == "mmap":
            mm = mmap.mmap(fd, N, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                src = torch.frombuffer(mm, dtype=torch.float32)
            dst.copy_(src); del src; mm.close()
        else:
            step = int(mode[5:]) << 20
            base = dst.data_ptr()
            for off in range(0, N, step):
                n = min(step, N - off)
                view = (ctypes.c_char * n).from_address(base + off)
                got = os.preadv(fd, [view], off)
                assert got == n
        return time.perf_counter() - t0, time.process_time() - c0
    modes = ("mmap", "pread5", "pread64")
    res = {m: [] for m in modes}
    for _ in range(4):
        for m in modes:
            res[m].append(run(m))
    for m, v in res.items():
        print(m, "wall", [round(a, 3) for a, _ in v], "cpu", [round(b, 3) for _, b in v])
finally:
    os.close(fd); os.unlink(path)

import mmap, os, socket, statistics, sys, time, multiprocessing as mp
sys.path.insert(0, "/work/main/bench")
import verified_floor as vf
SIZE = 1 << 30
PATH = "/dev/shm/spk-sendfile"

def holder(port):
    fd = os.open(PATH, os.O_RDWR)
    mm = mmap.mmap(fd, SIZE)
    buf = memoryview(mm)
    src = vf.TaggedSource(buf)
    s = socket.create_connection(("127.0.0.1", port)); vf.tune(s)
    while (w := s.recv(1)) in (b"c", b"z"):
        for n, (a, b) in enumerate(src.blocks):
            s.sendall(vf.PREFIX.pack(n, src.tags[n]), )
            if w == b"c":
                s.sendall(buf[a:b])
            else:
                off, left = a, b - a
                while left:
                    k = os.sendfile(s.fileno(), fd, off, left)
                    off += k; left -= k
    del src; buf.release(); mm.close(); os.close(fd)

def main():
    fd = os.open(PATH, os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, SIZE)
    mm = mmap.mmap(fd, SIZE); 
    for i in range(0, SIZE, 1 << 20): mm[i:i+8] = os.urandom(8)
    mm.close(); os.close(fd)
    srv = socket.create_server(("127.0.0.1", 0))
    p = mp.get_context("fork").Process(target=holder, args=(srv.getsockname()[1],)); p.start()
    c, _ = srv.accept(); vf.tune(c)
    dst = memoryview(bytearray(SIZE))
    dst[:] = b"\1" * 0 + bytes(SIZE)
    res = {"c": [], "z": []}
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
        for w in ("cz" if r % 2 else "zc"):
            t = time.perf_counter(); c.sendall(w.encode()); vf.receive(c, dst); res[w].append(time.perf_counter() - t)
    c.sendall(b"x"); p.join(); os.unlink(PATH)
    for w, v in res.items(): print(w, "median", round(statistics.median(v), 4), [round(x, 3) for x in v])
    print("sendfile speed over copy:", round(statistics.median(res["c"]) / statistics.median(res["z"]), 3),
          "paired", round(statistics.median(a / b for a, b in zip(res["c"], res["z"])), 3))
main()

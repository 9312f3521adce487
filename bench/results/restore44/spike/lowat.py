import os, socket, statistics, sys, time, multiprocessing as mp
sys.path.insert(0, "/work/main/bench")
import verified_floor as vf
SIZE = 1 << 30

def holder(port):
    buf = memoryview(bytearray(os.urandom(1 << 20) * 1024))
    src = vf.TaggedSource(buf)
    s = socket.create_connection(("127.0.0.1", port)); vf.tune(s)
    while s.recv(1) == b"v":
        src.send(s)

def receive_lowat(sock, buf, lo):
    prefix = memoryview(bytearray(vf.PREFIX.size))
    set_ = sock.setsockopt
    for off in range(0, len(buf), vf.BLOCK):
        set_(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        vf.recv_exactly(sock, prefix)
        n, tag = vf.PREFIX.unpack(prefix)
        mac = vf.BlockMac(n)
        view = buf[off: off + vf.BLOCK]
        got, need, cur = 0, len(view), 0
        while got < need:
            want = min(lo, need - got)
            if want != cur:
                set_(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want); cur = want
            k = sock.recv_into(view[got:])
            if not k: raise ConnectionError
            mac.update(view[got:got + k]); got += k
        if mac.tag() != tag: raise ValueError
    set_(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

def main():
    srv = socket.create_server(("127.0.0.1", 0))
    p = mp.get_context("fork").Process(target=holder, args=(srv.getsockname()[1],)); p.start()
    c, _ = srv.accept(); vf.tune(c)
    dst = memoryview(bytearray(SIZE)); dst[:] = bytes(SIZE)
    lo = int(sys.argv[2])
    res = {"plain": [], "lowat": []}
    for r in range(int(sys.argv[1])):
        for w in (["plain", "lowat"] if r % 2 else ["lowat", "plain"]):
            t = time.perf_counter(); c.sendall(b"v"); (receive_lowat(c, dst, lo) if w == "lowat" else vf.receive(c, dst)); res[w].append(time.perf_counter() - t)
    c.sendall(b"x"); p.join()
    for w, v in res.items(): print(w, "median", round(statistics.median(v), 4), [round(x, 3) for x in v])
    print("lowat speed over plain:", round(statistics.median(res["plain"]) / statistics.median(res["lowat"]), 3),
          "paired", round(statistics.median(a / b for a, b in zip(res["plain"], res["lowat"])), 3))
main()

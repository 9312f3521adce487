"""Holder CPU per GiB served: elasticd fetch vs verified-floor send, same holder process."""
import multiprocessing as mp, os, shutil, socket, sys, time, uuid, statistics
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import numpy as np
import verified_floor
from elasticd.snapshot.format import SnapshotHeader, TensorSpec, layout
from elasticd.store.shm import SlotStore
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator
from elasticd.recovery.replicator import Replicator
from elasticd.replication.seal import BlockTagger
from elasticd.replication.shm_sink import ShmSink
from elasticd.replication.transport import ReplicaServer
import bench_peer_restore as bp

SECRET = bp.SECRET
JOB, RANK = "bench", 0

def peer(conn, root, sizes):
    if os.environ.get("MB_PATCH"):
        exec(open(os.environ["MB_PATCH"]).read(), {})
    arrays = bp.make_arrays(sizes)
    specs = [TensorSpec(k, "float32", v.shape) for k, v in arrays.items()]
    lay = layout(specs, job=JOB)
    store = SlotStore(root)
    store.tagger = BlockTagger(SECRET).tag
    slot = store.reserve(JOB, RANK, lay.total_size)
    for e in lay.entries:
        np.frombuffer(slot.buffer, np.uint8, e.nbytes, e.offset)[:] = arrays[e.name].view(np.uint8)
    store.complete(slot, SnapshotHeader(JOB, 1, 0, RANK, 1, lay, {}))
    del arrays
    server = ReplicaServer("127.0.0.1", 0, SECRET, "peer", ShmSink(store), idle_timeout=600).start()
    payload = store.latest(JOB, RANK).buffer
    source = verified_floor.TaggedSource(payload)
    raw = socket.create_server(("127.0.0.1", 0))
    conn.send((server.address, raw.getsockname()[1], lay.total_size))
    sock, _ = raw.accept()
    verified_floor.tune(sock)
    with sock:
        while (what := sock.recv(1)) == b"v":
            source.send(sock)
    del source, payload
    raw.close(); server.stop(); store.close()

def main():
    mib = int(os.environ.get("MB_MIB", "384")); rounds = int(os.environ.get("MB_ROUNDS", "4"))
    sizes = bp.tensor_sizes(mib << 20, 100)
    root = f"/dev/shm/elasticd-mb-{uuid.uuid4().hex[:8]}"
    pipe, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=peer, args=(child, root, sizes), daemon=True)
    proc.start()
    try:
        address, raw_port, total = pipe.recv()
        import elasticd; print("holder pid", proc.pid, elasticd.__file__, flush=True)
        rep = Replicator("restorer", MemoryCoordinator(), Keyspace("/bench"), SlotStore(f"{root}-r"),
                         SECRET, m=2, peers_address=lambda n: address if n == "peer" else None, timeout=60.0)
        rep.set_membership(JOB, ["peer", "restorer"], {"peer": [RANK]})
        raw = socket.create_connection(("127.0.0.1", raw_port)); verified_floor.tune(raw)
        buf = bp.touched(total)
        rep.fetch(JOB, RANK, (0, 1), buf)
        if os.environ.get("MB_WAIT"):
            time.sleep(float(os.environ["MB_WAIT"]))
        res = {"peer": [], "floor": []}
        for _ in range(rounds):
            for name in ("peer", "floor"):
                h0 = bp.cpu_seconds(proc.pid); me = time.process_time(); t = time.perf_counter()
                if name == "peer":
                    rep.fetch(JOB, RANK, (0, 1), buf)
                else:
                    raw.sendall(b"v"); verified_floor.receive(raw, buf[:total])
                res[name].append((time.perf_counter() - t, bp.cpu_seconds(proc.pid) - h0, time.process_time() - me))
        gib = total / 2**30
        for k, v in res.items():
            print(k, "s %.3f holder cpu/GiB %.3f recv cpu/GiB %.3f" % (statistics.median(x[0] for x in v),
                  statistics.median(x[1] for x in v) / gib, statistics.median(x[2] for x in v) / gib))
        raw.close(); rep.close(); rep.store.close()
    finally:
        proc.join(30); shutil.rmtree(root, ignore_errors=True); shutil.rmtree(root + "-r", ignore_errors=True)

if __name__ == "__main__":
    main()

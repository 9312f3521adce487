"""Spike (issue 30, restore40): does a holder spend less CPU on a fetch when it builds every
frame's prefix first and then sends the frames back to back, instead of building each between
two multi-MiB ``sendmsg`` calls (where its Python may run with cold caches: restore39's
~35 ms/GiB of interpreter samples on the serving thread)?

The holder process (``bench_peer_restore.py``'s, 1 GiB in 300 tensors) gets a ``send_runs``
that reads a flag file on each call: ``a`` runs the product's ``send_runs``, ``b`` builds every
run prefix (and the untagged header's DATA prefix) in one pass, then sends. Fetches alternate
a/b, ``N`` pairs, the holder's CPU read around each::

    cpulock python bench/spikes/holder_batch.py 40
"""
import sys, os, time, statistics, shutil, uuid, socket
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import multiprocessing as mp
import bench_peer_restore as b
from proc_cpu import cpu_seconds
import elasticd.replication.channel as ch
import elasticd.replication.runs as runs
from elasticd.replication.messages import run_prefix, data_prefix
from elasticd.replication.wire import MAX_RUN_BLOCKS, RUN, RUN_ENTRY
from elasticd.recovery.replicator import Replicator
from elasticd.store.shm import SlotStore
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator
FLAG = f"/tmp/elasticd-holder-batch-{os.getpid()}"
real = runs.send_runs
def batched(channel, pieces, tags, chunk, max_frame):
    with open(FLAG) as f:
        if f.read().strip() != "b":
            return real(channel, pieces, tags, chunk, max_frame)
    out = []
    run = []; start = size = 0
    def close():
        out.append((run_prefix(start, [(len(c), t) for t, c in run], channel.send_key), *(c for _, c in run)))
    for at, piece in pieces:
        tag = tags.tag_at(at, len(piece))
        grown = RUN.size + (len(run) + 1) * RUN_ENTRY.size + size + len(piece)
        if run and (tag is None or size + len(piece) > chunk or len(run) == MAX_RUN_BLOCKS or grown > max_frame or at != start + size):
            close(); run = []
        if tag is None:
            out.append((data_prefix(at, piece, channel.send_key), piece)); continue
        if not run: start, size = at, 0
        run.append((tag, piece)); size += len(piece)
    if run: close()
    for parts in out:
        channel._send(*parts)
    return len(out)
ch.send_runs = batched
open(FLAG, "w").write("a")
sizes = b.tensor_sizes(1024 << 20, 300)
root = f"/dev/shm/elasticd-bab-{uuid.uuid4().hex[:8]}"
pipe, child = mp.Pipe()
proc = mp.get_context("fork").Process(target=b.peer, args=(child, root, sizes), daemon=True); proc.start()
address, raw_port, total = pipe.recv()
rep = Replicator("restorer", MemoryCoordinator(), Keyspace("/bench"), SlotStore(f"{root}-r"), b.SECRET, m=2,
                 peers_address=lambda n: address if n == "peer" else None, timeout=60.0)
rep.set_membership(b.JOB, ["peer", "restorer"], {"peer": [b.RANK]})
buf = b.touched(total)
rep.fetch(b.JOB, b.RANK, (0, 1), buf)
res = {"a": [], "b": []}; wall = {"a": [], "b": []}
N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
for i in range(N):
    for m in (("a", "b") if i % 2 == 0 else ("b", "a")):
        open(FLAG, "w").write(m)
        c0 = cpu_seconds(proc.pid); t0 = time.perf_counter()
        rep.fetch(b.JOB, b.RANK, (0, 1), buf)
        wall[m].append(time.perf_counter() - t0); res[m].append(cpu_seconds(proc.pid) - c0)
for m in res: print(m, "holder cpu med", round(statistics.median(res[m]), 4), "wall med", round(statistics.median(wall[m]), 4))
print("b lower cpu in", sum(y < x for x, y in zip(res["a"], res["b"])), "of", N, "; paired cpu ratio", round(statistics.median(y / x for x, y in zip(res["a"], res["b"])), 3), "wall ratio", round(statistics.median(y / x for x, y in zip(wall["a"], wall["b"])), 3))
raw = socket.create_connection(("127.0.0.1", raw_port)); raw.sendall(b"q"); raw.close()
rep.close(); rep.store.close(); proc.join(30)
shutil.rmtree(root, ignore_errors=True); shutil.rmtree(f"{root}-r", ignore_errors=True)
os.unlink(FLAG)

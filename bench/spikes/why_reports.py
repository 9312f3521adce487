"""Why does a node send ~3.5 reports per step? N nodes' commit code on the in-memory
coordinator, snapshots at 1 Hz, reports in-process; counts what made each report due.

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/spikes/why_reports.py 30 15

2026-11-29, branch scale22: N=30 steps=15 reports/node/step=1.93 {'sent after changed': 450,
'sent after hopeless-ask': 450}: one report per step for the new version, the rest questions.
"""
import collections, random, sys, threading, time
sys.path.insert(0, "bench")
from commit_harness import JOB, HarnessNode, LocalReports
from elasticd.coordination.keys import Keyspace
from elasticd.replication.placement import compute_placement
from elasticd.replication import reporter as R
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore

N, SECS = int(sys.argv[1]), float(sys.argv[2])
why = collections.Counter()
last = {}
orig_changed, orig_hopeless, orig_answered, orig_failed, orig_send = (
    R.Reporter.changed, R.Reporter.hopeless, R.Reporter._answered, R.Reporter._failed, R.Reporter._send_once)
def changed(self, job):
    last[id(self)] = "changed"; return orig_changed(self, job)
def hopeless(self, job, version, *a, **k):
    with self.t.lock:
        j = self.jobs.get(job); before = j.dirty if j else None
    r = orig_hopeless(self, job, version, *a, **k)
    with self.t.lock:
        if j is not None and j.dirty and not before: last[id(self)] = "hopeless-ask"
    return r
def answered(self, job, j, ship, reply):
    again = orig_answered(self, job, j, ship, reply)
    if again: why["again(dirty during send)"] += 1
    if not reply.accepted: why["refused:" + reply.reason] += 1
    return again
def send_once(self, job):
    with self.t.lock:
        j = self.jobs.get(job); due = j is not None and j.dirty
    if due:
        why["sent after " + last.get(id(self), "?")] += 1
    return orig_send(self, job)
R.Reporter.changed, R.Reporter.hopeless, R.Reporter._answered, R.Reporter._send_once = changed, hopeless, answered, send_once

store = MemoryStore()
keys = Keyspace("/d")
reports = LocalReports()
names = [f"node-{i:05d}" for i in range(N)]
nodes = [HarnessNode(nm, MemoryCoordinator(store), keys, reports, 2.0) for nm in names]
placement = compute_placement(names, {nm: range(k * 8, (k + 1) * 8) for k, nm in enumerate(names)}, 2, round=1)
for n in nodes: n.join(placement)
stop = threading.Event()
def ticker():
    while not stop.wait(0.1):
        for n in nodes: n.tick()
threading.Thread(target=ticker, daemon=True).start()
time.sleep(3)
t0 = time.monotonic(); step = 0
why.clear(); sent0 = reports.sent
while time.monotonic() - t0 < SECS:
    step += 1
    for n in random.sample(nodes, len(nodes)):
        if step % n.tracker.prefix.grid(JOB) == 0:
            n.snapshot(placement, step)
    time.sleep(max(0, t0 + step - time.monotonic()))
stop.set()
sent = reports.sent - sent0
print(f"N={N} steps={step} reports/node/step={sent / N / step:.2f}", dict(why), "committed", nodes[0].committed())

"""Does etcd's database grow with a job's length under the per-step commit's writes?

The N = 1,000 commit window (``scale_native.py --commit-only``) measures etcd's database after
the window's first minute and at its end; session 33 found +11.9 % in 9 minutes. This bench
writes the same keys at the same rate per committed step, on one etcd member started as
elasticd embeds it (``EmbeddedEtcd``: revision auto-compaction keeping 10,000 revisions, run by
etcd every 5 minutes), for many hours of training compressed into a minute or two, and
compacts as that policy would at one committed step per second (every ``--compact-every``
steps, to the revision ``--retention`` revisions back). It samples the database's size
(``etcd_mvcc_db_total_size_in_bytes``, what the window measures) and the part in use, the
revision and the compacted revision, so the growth splits into history kept (until the first
compaction that reaches it) and a database that stops growing after it.

Per committed step, as measured at N = 1,000 (session 33: 1.825 revisions and 2.12 keys per
committed step, largest 179 B, median 76 B): one transaction writing the committed record
(178 B) and, every third step, the grid record (56 B); on five steps of six the ahead record
(75 B) apart: 1.83 revisions and 2.17 keys per step. Fences (rare once training is steady)
are not written. The data directory is on tmpfs (the size of the database does not depend on
fsync; the writes are faster).

Usage: python bench/scale_db_history.py --steps 18000 --out bench/results/<file>.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from elasticd.coordination.api import Put  # noqa: E402
from elasticd.coordination.embedded import EmbeddedEtcd  # noqa: E402
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints  # noqa: E402
from elasticd.coordination.keys import Keyspace  # noqa: E402
from scale_sim import scrape  # noqa: E402


def sample(url: str, step: int) -> dict[str, float]:
    m = scrape(url)
    return {"step": step, **{k: int(m.get((name, ""), -1.0)) for k, name in (
        ("revision", "etcd_debugging_mvcc_current_revision"),
        ("compact_revision", "etcd_debugging_mvcc_compact_revision"),
        ("db_bytes", "etcd_mvcc_db_total_size_in_bytes"),
        ("db_bytes_in_use", "etcd_mvcc_db_total_size_in_use_in_bytes"))}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=18000, help="committed steps written")
    p.add_argument("--retention", type=int, default=10000,
                   help="revisions kept (EmbeddedEtcd's --auto-compaction-retention)")
    p.add_argument("--compact-every", type=int, default=300,
                   help="steps between compactions (etcd's 5 minutes at a step a second)")
    p.add_argument("--sample-every", type=int, default=300)
    p.add_argument("--out", default="")
    a = p.parse_args()
    data = tempfile.mkdtemp(prefix="elasticd-etcd-", dir="/dev/shm")
    etcd = EmbeddedEtcd(1, data_dir=data).start()
    coord = EtcdCoordinator(EtcdSettings(parse_endpoints(etcd.endpoints), timeout=10.0))
    url = f"http://{etcd.members[0].endpoint}/metrics"
    k = Keyspace("/elasticd-db-history").replication("job")
    samples = [sample(url, 0)]
    started, compactions, revision = time.monotonic(), 0, 0
    try:
        for step in range(1, a.steps + 1):
            body = (b'{"v":[0,%d],"by":"node-00000","term":"f568c5b3a8fd255",' % step).ljust(
                177, b"x") + b"}"
            ops = [Put(k.committed, body)]
            if step % 3 == 0:
                ops.append(Put(k.commit_grid, b'{"grid":1,"step":%d}' % step))
            revision = coord.transaction([], ops)[1]
            if step % 6:
                revision = coord.put(k.commit_ahead, (b'{"v":[0,%d]' % (step + 1)).ljust(74, b" ")
                                     + b"}")
            if step % a.compact_every == 0 and revision - a.retention > 0:
                coord.connection.call(lambda c: c.compact(revision - a.retention))
                compactions += 1
            if step % a.sample_every == 0:
                samples.append(sample(url, step))
    finally:
        coord.close()
        etcd.stop()
        shutil.rmtree(data, ignore_errors=True)
    first = next((s for s in samples if s["step"] >= 60), samples[-1])
    ten = next((s for s in samples if s["step"] >= 600), samples[-1])
    result = {
        "benchmark": "etcd database size under the per-step commit's writes, many hours",
        "command": "python bench/scale_db_history.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - started, 1),
        "parameters": vars(a),
        "revisions_per_step": round((samples[-1]["revision"] - samples[0]["revision"])
                                    / a.steps, 3),
        "compactions": compactions,
        "db_growth_pct_step_60_to_600": round((ten["db_bytes"] - first["db_bytes"])
                                              / first["db_bytes"] * 100, 2),
        "db_bytes_max": max(s["db_bytes"] for s in samples),
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

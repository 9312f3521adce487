"""The README's "What to change in your script" snippet, extracted from README.md (so the two
cannot drift), is a complete script that makes a job protected by itself: it calls nothing of
elasticd but the Checkpointer, the sampler and RNGState (no progress()), and as a daemon-run job
on 3 nodes with replication, kill -9 of the node holding rank 0 makes the survivors restore the
committed step from a peer's RAM."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time

import pytest

from elasticd.launcher import JOB_USER, LocalCluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLOWED = {"Checkpointer", "ElasticSampler", "RNGState"}  # elasticd.<name>
ALLOWED_CALLS = {"restore", "save", "close"}  # on the Checkpointer


def readme_snippet() -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("### What to change in your script", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "no python block in the README's checkpoint section"
    return m.group(1)


def elasticd_uses(source: str) -> tuple[set[str], set[str], list[str]]:
    """(elasticd.<names>, methods called on Checkpointer objects, other elasticd imports)."""
    tree = ast.parse(source)
    names, calls, imports = set(), set(), []
    ckpts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("elasticd"):
            imports.append(node.module)
        if isinstance(node, ast.Import):
            imports += [a.name for a in node.names
                        if a.name.startswith("elasticd") and a.name != "elasticd"]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "elasticd":
            names.add(node.attr)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Attribute) \
                and node.value.func.attr == "Checkpointer":
            ckpts |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ckpts:
            calls.add(node.attr)
    return names, calls, imports


def test_the_snippet_uses_only_the_checkpointer_sampler_and_rng_state():
    names, calls, imports = elasticd_uses(readme_snippet())
    assert names == ALLOWED, names
    assert calls == ALLOWED_CALLS, calls
    assert imports == []
    assert "progress" not in readme_snippet()
    # the checker itself sees what it must refuse
    bad = "import elasticd\nfrom elasticd.worker import progress\nc = elasticd.Checkpointer()\n" \
          "c.restore({})\nc.wait()\nelasticd.worker.progress(1)\n"
    n, c, i = elasticd_uses(bad)
    assert n - ALLOWED and c - ALLOWED_CALLS and i


def ctl(c: LocalCluster, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
    return subprocess.run([sys.executable, "-m", "elasticd.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.etcd
@pytest.mark.timeout(240)
def test_the_snippet_as_a_job_survives_kill9_of_rank0s_node_from_a_peers_ram(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(readme_snippet())
    c = LocalCluster(["n1", "n2", "n3"], workdir=str(tmp_path / "cluster"), lease_ttl=2,
                     replication=True, extra_args=["--replicas", "2"])
    try:
        c.start()
        res = ctl(c, "submit", "tiny", "--nnodes", "2:3", "--nproc-per-node", "1", "--user",
                  JOB_USER, "--", str(script))
        assert res.returncode == 0, res.stderr

        def committed():
            from elasticd.replication.commit import read_committed

            got = read_committed(c.coordinator(), c.keys, "tiny")
            return got.version if got is not None else None

        def placed_and_committed():
            st = {n: c.nodes[n].http("/status") for n in c.nodes}
            ranks = {n: s["job"]["ranks"] for n, s in st.items()}
            version = committed()
            ok = sorted(r for rs in ranks.values() for r in rs) == [0, 1, 2] and \
                version is not None and version[1] >= 60
            return ok and (st, ranks, version)

        st, ranks, _ = c.wait_for(placed_and_committed, 120,
                                  "3 ranks placed and step 60 committed")
        assert all(s["replication"]["jobs"]["tiny"]["placement"] for s in st.values())
        victim = next(n for n, rs in ranks.items() if rs == [0])
        survivors = [n for n in c.nodes if n != victim]
        before = committed()
        killed_at = time.time()
        c.nodes[victim].kill()
        killed = time.monotonic()
        # The newest step the survivors reached: what the sync lag at the kill is measured to.
        reached = max(c.nodes[n].http("/status")["job"]["last_step"] for n in survivors)
        after = committed()

        def restores():
            found = [e for e in c.events() if e["kind"] == "recovered"
                     and e["data"].get("job") == "tiny" and e["at"] > killed_at]
            return len({e["data"]["rank"] for e in found}) >= 2 and found

        found = c.wait_for(restores, 120, "both survivors restored")
        print(f"kill -9 {victim} (committed {before[1]}..{after[1]}, reached {reached}): "
              f"restored after {time.monotonic() - killed:.1f} s:",
              [(e["data"]["rank"], e["data"]["source"], e["data"]["step"],
                e["data"]["steps_lost"]) for e in found])
        steps = {e["data"]["step"] for e in found}
        assert len(steps) == 1, "ranks restored different steps"
        step = steps.pop()
        assert before[1] <= step <= after[1], "did not restore the committed step"
        assert any(e["data"]["source"] == "peer" for e in found), found
        lag = reached - before[1]  # the sync lag at the kill, at most
        assert all(e["data"]["steps_lost"] <= lag for e in found), (lag, found)
        c.wait_for(lambda: all(c.nodes[n].http("/status")["job"]["last_step"] > step + 5
                               for n in survivors), 90, "training again on the survivors")
    finally:
        c.stop()

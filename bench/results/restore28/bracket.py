"""bracket.json from hold 3's output: per block (base, head, head, base), the kill -9 recovery
bench's runs (recovery_block*.json here) and the FSDP2 chaos test's wall time and its ranks'
restore times (read from the test's log and the files it keeps). Usage: bracket.py LOGDIR"""

import glob
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESTORED = re.compile(r"restored step (\d+) \(generation \d+\) from (\w+) in ([\d.]+) s")


def fsdp(log: str) -> dict:
    text = open(log).read()
    call = re.search(r"([\d.]+)s call\s+tests/chaos/test_sharded_reshard.py", text)
    outcome = re.findall(r"(\d+ passed|\d+ failed)", text)
    kept = re.search(r"kept in (/tmp/elasticd-tests/\S+)", text)
    restores = []
    if kept:
        for path in glob.glob(os.path.join(kept.group(1), "**", "*.log"), recursive=True):
            try:
                body = open(path, errors="replace").read()
            except OSError:
                continue
            restores += [(int(s), src, float(t)) for s, src, t in RESTORED.findall(body)]
    peer = sorted(t for _, src, t in restores if src == "peer")
    return {"call_seconds": float(call.group(1)) if call else None,
            "outcome": outcome[-1] if outcome else None,
            "rank_restores_from_peer_seconds": peer,
            "rank_restore_seconds_median": round(statistics.median(peer), 3) if peer else None,
            "log_dir": kept.group(1) if kept else None}


def main(logdir: str) -> None:
    blocks = []
    for path in sorted(glob.glob(os.path.join(HERE, "recovery_block*.json"))):
        k, tree = re.search(r"block(\d+)_(\w+)\.json", path).groups()
        r = json.load(open(path))["elasticd"]
        fl = os.path.join(logdir, f"fsdp_block{k}_{tree}.log")
        blocks.append({"block": int(k), "tree": tree,
                       "kill9_recovery_seconds": [round(d["seconds"], 3) for d in r["detail"]
                                                  if d.get("recovered")],
                       "kill9_steps_lost": [d.get("steps_lost") for d in r["detail"]],
                       "kill9_median_seconds": r["median_seconds"],
                       "fsdp2_chaos": fsdp(fl) if os.path.exists(fl) else None})
    out = {"what": "kill -9 recovery bench (restart path, elasticd, --runs 1 a block) and the "
                   "FSDP2 chaos test, base 3f48c4f (before issue 30) against head 7a92980, "
                   "blocks base, head, head, base in one hold (hold3.sh)",
           "blocks": blocks}
    for tree in sorted({b["tree"] for b in blocks}):
        mine = [b for b in blocks if b["tree"] == tree]
        rec = [s for b in mine for s in b["kill9_recovery_seconds"]]
        calls = [b["fsdp2_chaos"]["call_seconds"] for b in mine
                 if b["fsdp2_chaos"] and b["fsdp2_chaos"]["call_seconds"]]
        rest = [s for b in mine if b["fsdp2_chaos"]
                for s in b["fsdp2_chaos"]["rank_restores_from_peer_seconds"]]
        out[tree] = {"kill9_recovery_median_seconds": round(statistics.median(rec), 3)
                     if rec else None, "kill9_runs": len(rec),
                     "fsdp2_chaos_call_seconds": calls,
                     "fsdp2_rank_restore_from_peer_median_seconds":
                         round(statistics.median(rest), 3) if rest else None}
    with open(os.path.join(HERE, "bracket.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps({k: v for k, v in out.items() if k != "blocks"}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/r28/h3")

"""Hold 1's perf samples by role and kind (perf_hold1.txt): where the CPU of the sharded
restore bench's timed rounds goes, elasticd's processes against the verified floor's.

Input: ``perf script -F pid,tid,time,ip,sym,dso`` of hold1.sh's ``perf record -a -F 999``
(one sample = ~1 ms of one CPU). The pids and tids below are that run's (hold1.sh's
threads.txt): the bench forked holders h0..h2 (26912, 26915, 26918) and daemons n0, n1
(26921, 26926) and spawned workers rank 0, 1 (28301, 28302). The floor's senders are each
holder's one raw-sender thread (26914, 26917, 26920), its receivers three short threads per
worker per round; elasticd's holders serve on one thread per daemon connection, the daemons
fetch on one thread per holder per old rank. Timed rounds: t = 881-897 s (rounds 1-3; each
round runs elasticd, dcp warm, dcp cold, then the floor). Workers: the main thread from the
daemons' last fetch sample of a round to the bench's first xxh3 digest after it (the load:
the reshard's preadv and the load_state_dict), per round.

    perf script -i perf.data -F pid,tid,time,ip,sym,dso > script.txt
    python perf_roles.py script.txt
"""

import collections
import re
import sys

ROLES = {26912: "holder h0", 26915: "holder h1", 26918: "holder h2", 26921: "daemon n0",
         26926: "daemon n1", 28301: "worker 0", 28302: "worker 1"}
FLOOR_SENDERS = {26914, 26917, 26920}
FLOOR_RECEIVERS = {30214, 30215, 30216, 30217, 30218, 30219, 30424, 30425, 30426, 30427, 30428,
                   30429, 30596, 30597, 30598, 30599, 30600, 30601}
TIMED = (881.0, 897.0)
ROUNDS = 3
# (daemons' last fetch sample) of each timed round: a worker's load starts there
FETCH_ENDS = (882.258, 886.465, 891.721)


def kind(sym: str, dso: str) -> str:
    base = dso.split("/")[-1]
    if "kallsyms" in dso:
        if re.search(r"copy_user|_copy_to_iter|_copy_from_iter|rep_movs|copy_page|memcpy", sym):
            return "kernel copy"
        if re.search(r"shmem|filemap|xas_|folio|pte|handle_mm|fault|lru|tlb|madvise|clear_page",
                     sym):
            return "kernel pages"
        return "kernel other (tcp, syscalls, scheduling)"
    if "_rust" in base:
        return "Poly1305 (cryptography)"
    if base.startswith("python3"):
        return "Python interpreter"
    if "torch" in base or "c10" in base:
        return "torch"
    if "xxhash" in base:
        return "xxh3"
    return "other user (libc, ...)"


def main(path: str) -> None:
    line_re = re.compile(r"\s*(\d+)/(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+(.*) \((.*)\)\s*$")
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    worker_rows = []
    for line in open(path):
        m = line_re.match(line)
        if not m:
            continue
        pid, tid, t = int(m[1]), int(m[2]), float(m[3])
        if pid not in ROLES or pid == tid and pid < 28000:  # holders'/daemons' main: teardown
            continue
        k = kind(m[4], m[5])
        if pid in (28301, 28302) and pid == tid:
            worker_rows.append((t, ROLES[pid], k, m[5]))
            continue
        if not TIMED[0] <= t <= TIMED[1]:
            continue
        if tid in FLOOR_SENDERS:
            per["floor senders (3)"][k] += 1
        elif tid in FLOOR_RECEIVERS:
            per["floor receivers (2 ranks)"][k] += 1
        elif ROLES[pid].startswith("holder"):
            per["elasticd holders (3)"][k] += 1
        elif ROLES[pid].startswith("daemon"):
            per["elasticd daemons (2)"][k] += 1
    for end in FETCH_ENDS:  # the workers' loads
        for w in ("worker 0", "worker 1"):
            mine = [r for r in worker_rows if r[1] == w]
            stop = next((t for t, _, _, dso in mine if t > end and "xxhash" in dso), end + 1)
            for t, _, k, _ in mine:
                if end - 0.05 < t < stop:
                    per["elasticd workers' load (2)"][k] += 1
    kinds = sorted({k for c in per.values() for k in c})
    print("CPU ms per restore (perf samples at 999 Hz / 3 timed rounds), by kind")
    print("| | total | " + " | ".join(kinds) + " |")
    print("|---|---:|" + "---:|" * len(kinds))
    for role in ("elasticd daemons (2)", "floor receivers (2 ranks)", "elasticd holders (3)",
                 "floor senders (3)", "elasticd workers' load (2)"):
        c = per[role]
        print(f"| {role} | {sum(c.values()) / ROUNDS:.0f} | "
              + " | ".join(f"{c[k] / ROUNDS:.0f}" for k in kinds) + " |")


if __name__ == "__main__":
    main(sys.argv[1])

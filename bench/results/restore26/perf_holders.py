"""Holder threads of a perf -a -g recording: elasticd's serving threads (sendmsg) against the
verified floor's sender threads (sendto), by where the samples fall (kernel function groups)."""
import collections, sys
holders = set(sys.argv[2].split(","))
def group(names):
    s = " ".join(names)
    leaf = names[0] if names else "?"
    if "asm_exc_page_fault" in s: return "page fault"
    if "__sys_sendmsg" in s or "__sys_sendto" in s:
        if "copy_from_iter" in leaf or "copy_user" in leaf: return "send: copy from user"
        if "__tcp_push_pending_frames" in s or "tcp_write_xmit" in s:
            if "tcp_v4_rcv" in s or "__netif_receive_skb" in s or "net_rx_action" in s: return "send: loopback rx processing"
            return "send: tcp xmit"
        if "sk_stream_wait_memory" in s or "schedule" in s: return "send: wait/schedule"
        return "send: other kernel"
    if "do_sys_poll" in s or "__x64_sys_poll" in s: return "poll"
    if "__sys_recvfrom" in s or "recvmsg" in s:
        return "recv (requests)"
    if "entry_SYSCALL" in s: return "other syscalls"
    if "irq" in s: return "irq"
    if "poly1305" in leaf or "chacha" in leaf.lower(): return "crypto"
    return "user (python, libs)"
votes = collections.defaultdict(collections.Counter); cnt = collections.defaultdict(collections.Counter)
cur = None; frames = []
def flush():
    if cur is None: return
    pid, tid = cur
    if pid not in holders: return
    names = [f.split()[1] if len(f.split()) > 1 else f for f in frames]
    s = " ".join(names)
    if "__sys_sendmsg" in s: votes[tid]["serve"] += 1
    elif "__sys_sendto" in s: votes[tid]["floor"] += 1
    cnt[tid][group(names)] += 1
for line in open(sys.argv[1], errors="replace"):
    if line and not line[0].isspace():
        flush()
        p = line.split()
        cur = tuple(p[1].split("/")) if len(p) > 1 and "/" in p[1] else None; frames = []
    elif line.strip():
        frames.append(line.strip())
flush()
tot = {"serve": collections.Counter(), "floor": collections.Counter()}
for tid, c in cnt.items():
    k = votes[tid].most_common(1)[0][0] if votes[tid] and votes[tid].most_common(1)[0][1] > 20 else None
    if k: tot[k].update(c)
for k, c in tot.items():
    n = sum(c.values())
    print(f"{k}: {n} samples")
    for g, v in c.most_common(): print(f"   {g:32s} {v:6d} {v*100/max(n,1):5.1f}%")

"""The scale simulator's keep-alive process made cheaper (bench/refresh_plan.py, bench/h2_keepalive.py):
a node's leases refreshed together on its stream, never later than TTL/3 after their last
refresh, and a raw stream read in the loop's callback as it was by a reader task."""

from __future__ import annotations

import asyncio
import struct

from tests.bench_modules import load

PERIOD = 2.0 / 3


def _sent_together(plan, leases, until, answer_after=0.01):
    """Drives ``plan`` as the keep-alive process does (answers ``answer_after`` later);
    returns each send's (time, leases sent at that time, by stream)."""
    sends = []
    t = 0.0
    while t < until:
        batch = plan.due(t)
        by_stream = {}
        for _due, lease in batch:
            by_stream.setdefault(plan.stream(lease), []).append(lease)
        for k, ls in by_stream.items():
            sends.append((round(t, 2), k, sorted(ls)))
        for _due, lease in batch:  # answered: the next TTL/3 after this send
            plan.schedule(lease, max(t + PERIOD, t + answer_after + 0.05), t + answer_after)
        t = round(t + 0.02, 2)
    return sends


def test_a_nodes_two_leases_go_out_together_after_the_first_round_never_late():
    rp = load("refresh_plan")
    plan = rp.RefreshPlan(streams=10, by_node=True)
    plan.add(101, 3, 0.0 + PERIOD, 0.0)   # the daemon's lease at registration
    plan.add(202, 3, 0.3 + PERIOD, 0.3)   # the agent's, granted at its join 0.3 s later
    plan.add(999, 4, 0.1 + PERIOD, 0.1)   # another node's: a stream of its own
    sends = _sent_together(plan, {101, 202, 999}, 6.0)
    assert {k for _t, k, _l in sends if 101 in _l or 202 in _l} == {3}
    mine = [(t, ls) for t, k, ls in sends if k == 3]
    # the agent's first refresh goes with the daemon's, sooner than its own TTL/3, and
    # from then on the node's two leases leave in one frame
    assert mine[0] == (0.68, [101, 202])
    assert len(mine) >= 8 and all(ls == [101, 202] for _t, ls in mine)
    # and neither waited longer than TTL/3 (+ one 20 ms tick) after its previous refresh
    last = {101: 0.0, 202: 0.3}
    for t, ls in mine:
        for lease in ls:
            assert t - last[lease] <= PERIOD + 0.021
            last[lease] = t
    assert [ls for _t, k, ls in sends if k == 4] and all(
        ls == [999] for _t, k, ls in sends if k == 4)


def test_without_by_node_each_lease_keeps_its_own_cadence_on_its_id_stream():
    rp = load("refresh_plan")
    plan = rp.RefreshPlan(streams=10, by_node=False)
    plan.add(101, 3, PERIOD, 0.0)
    plan.add(202, 3, 0.3 + PERIOD, 0.3)
    sends = _sent_together(plan, {101, 202}, 4.0)
    assert {k for _t, k, _l in sends} == {1, 2}  # 101 % 10, 202 % 10
    assert all(len(ls) == 1 for _t, _k, ls in sends)


def _h2_frame(kind, flags, stream, payload=b""):
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, kind, flags, stream) + payload


def _answer(lease, ttl):
    h2 = load("h2_keepalive")
    msg = b"\x10" + h2.varint(lease) + b"\x18" + h2.varint(ttl)
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def _serve_answers(protocol):
    """A raw keep-alive stream against a server that answers two refreshes in one DATA frame,
    split across two TCP writes, then ends the stream: what the stream reports."""
    h2 = load("h2_keepalive")
    got, broken = [], []

    async def main():
        async def handle(reader, writer):
            await reader.read(1 << 16)  # the preface, SETTINGS, the request headers
            data = _answer(7, 2) + _answer(8, 0)
            body = (_h2_frame(4, 0, 0, struct.pack(">HI", 5, 32768))  # SETTINGS
                    + _h2_frame(6, 0, 0, b"12345678")  # a PING, to be acknowledged
                    + _h2_frame(0, 0, 1, data))
            writer.write(body[:20])
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(body[20:])
            await writer.drain()
            acks = b""
            while b"12345678" not in acks:  # the SETTINGS and PING acknowledgements
                acks += await asyncio.wait_for(reader.read(1 << 16), 2.0)
            got.append(("acks", acks))
            writer.write(_h2_frame(3, 0, 1, b"\x00\x00\x00\x00"))  # RST_STREAM: it ended
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ka = h2.RawKeepAlive("127.0.0.1", port, lambda i, t: got.append((i, t)),
                             lambda: broken.append(1), protocol=protocol)
        await ka.open()
        for _ in range(100):
            if broken:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # the connection's close must not report a second end
        server.close()
        return ka

    ka = asyncio.run(main())
    return got, broken, ka


def test_a_stream_read_in_the_loops_callback_answers_as_the_reader_task_did():
    for protocol in (False, True):
        got, broken, ka = _serve_answers(protocol)
        answers = [g for g in got if g[0] != "acks"]
        assert answers == [(7, 2), (8, 0)], protocol
        acks = [g[1] for g in got if g[0] == "acks"]
        assert acks and b"12345678" in acks[0], protocol  # the PING acknowledged
        assert ka.max_frame == 32768, protocol
        assert broken == [1], protocol  # the stream's end, told once
        assert ka.writer is None, protocol

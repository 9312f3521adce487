"""Getting shards back: fetching from whichever holder has an intact copy.

:func:`fetch_shard` copies a shard from this node's own memory or stripes it across every remote
holder, checked end to end (header and every payload block's xxh3); when no holder has an intact
copy it raises :class:`~elasticd.replication.api.ShardLost`, which tells the caller to use the
persistent tier. :func:`fetch_into_store` lands a fetched shard in a slot store, where the
worker's usual ``ckpt_open`` finds it. Daemon side: no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Iterable, Protocol, Sequence

from elasticd.snapshot.format import SnapshotError, SnapshotHeader
from elasticd.snapshot.reader import parse_header, verify_block, verify_payload
from elasticd.store.api import OverBudget
from elasticd.store.shm import SlotStore
from elasticd.clock import Clock
from elasticd.replication.api import (
    NOT_FOUND,
    ConnectionLost,
    DeadlineExceeded,
    Descriptor,
    Refused,
    RemoteError,
    ReplicationError,
    ShardLost,
    Version,
)
from elasticd.replication.commit import Committed
from elasticd.replication.deadline import LinkRates
from elasticd.replication.lanes import Connections, NoAddress
from elasticd.replication.messages import MAX_FETCH_RANGES
from elasticd.replication.placement import Placement
from elasticd.replication.scatter import Spans, landing, staged
from elasticd.replication.shm_sink import descriptor_of, pinned_view
from elasticd.replication.wire import (
    BlockTagMismatch,
    ChecksumMismatch,
    ForgedFrame,
    ProtocolError,
    TruncatedFrame,
)

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class FetchResult:
    """A shard now in the caller's buffer.

    Attributes:
        holder: the node whose copy was used (this node for its own memory); striped, the
            one that served the most bytes.
        descriptor: sizes and version; the bytes are ``into[:descriptor.total_bytes]``.
        wire_bytes: bytes received over the replication transport (0 from this node's memory).
        seconds: time spent, failed attempts included.
        attempts: (holder, reason) of each holder that failed before (or, striped, meanwhile:
            its unfinished ranges went to the others).
        served: (holder, snapshot bytes) each holder provided, in the order they started.
    """

    holder: str
    descriptor: Descriptor
    wire_bytes: int
    seconds: float
    attempts: tuple[tuple[str, str], ...] = ()
    served: tuple[tuple[str, int], ...] = ()
    #: The store's scratch segment holding a partial copy (:func:`fetch_into_scratch`).
    scratch: Any = None
    #: Payload bytes that came with their owner's block tags and were checked against them
    #: as they landed (the rest were checked against the header's checksums).
    tag_checked_bytes: int = 0


#: A striped fetch asks each holder for pieces of whole checksum blocks, one piece at a time
#: per holder: a faster holder serves more pieces, and a holder that fails leaves only its
#: unfinished piece to the others. A piece costs a round trip and its check before the next
#: request, while the holder's sender waits: ~2 ms per 16 MiB piece here (one holder, 1 GiB:
#: 0.64 s in 16 MiB pieces, 0.53 s in 256 MiB). So pieces are as large as PIECE_SECONDS of
#: the slowest holder's measured rate allows (a frozen holder costs its piece's deadline,
#: floor + slack * PIECE_SECONDS), and at most a PIECES_PER_HOLDER-th of each holder's share,
#: from STRIPE_BYTES to MAX_STRIPE_BYTES.
STRIPE_BYTES = 16 << 20
MAX_STRIPE_BYTES = 256 << 20
PIECE_SECONDS = 0.25
PIECES_PER_HOLDER = 4


def stripe_size(payload_bytes: int, holders: int, rate: float) -> int:
    """The piece size for a payload fetched from ``holders`` holders at once, the slowest of
    them measured at ``rate`` bytes/s."""
    share = payload_bytes // (PIECES_PER_HOLDER * max(1, holders))
    return min(MAX_STRIPE_BYTES, max(STRIPE_BYTES, min(share, int(rate * PIECE_SECONDS))))


def holder_order(job: str, rank: int, version: Version | None, me: str,
                 committed: Committed | None,
                 placements: Iterable[Placement | None]) -> list[str]:
    """Holders to try, in order: this node first (no network), then the committed record's
    holders of the rank (when it records ``version``), then each placement's holders."""
    order: list[str] = []
    if committed is not None and (version is None or committed.version == tuple(version)):
        order.extend(committed.holders.get(rank, ()))
    for p in placements:
        if p is not None and any(rank in rs for rs in p.ranks.values()):
            order.extend(p.holders_of_rank(rank))
    return list(dict.fromkeys([me, *order]))


def check_header(view: memoryview, d: Descriptor, where: str) -> SnapshotHeader:
    """Parses and checks the header of a copy against its descriptor. Raises: SnapshotError."""
    header = parse_header(view, job=d.job, rank=d.owner_rank, where=where)
    if header.version() != d.version or header.layout.total_size != d.total_bytes:
        raise SnapshotError(f"{where}: holds {header.version()} of "
                            f"{header.layout.total_size} bytes, announced {d.version} of "
                            f"{d.total_bytes}")
    return header


def _reason(holder: str, exc: BaseException, connections: Connections) -> str:
    """Why ``holder`` failed, for ``attempts``; drops its connection when it is unusable."""
    if isinstance(exc, Refused):
        return "missing" if exc.reason == NOT_FOUND else exc.reason
    if isinstance(exc, SnapshotError):
        log.error("REFUSED a copy held by %s: %s", holder, exc)
        return f"corrupt: {exc}"
    if isinstance(exc, BlockTagMismatch):
        # The holder's bytes are not those its owner sealed (its memory rotted, or a relay
        # altered them): refused like a checksum mismatch; the stream is cut mid-frame.
        log.error("REFUSED a copy served by %s: %s", holder, exc)
        connections.discard(holder)
        return f"corrupt: {exc}"
    if isinstance(exc, NoAddress):
        return "no address"
    connections.discard(holder)
    if isinstance(exc, (ForgedFrame, ChecksumMismatch)):
        # A frame that fails its session tag or checksum: altered on the way, or by the
        # holder, as a block that fails its tag is.
        log.error("REFUSED a copy served by %s: %s", holder, exc)
        return f"corrupt: {exc}"
    if isinstance(exc, RemoteError) or (isinstance(exc, ProtocolError)
                                        and not isinstance(exc, TruncatedFrame)):
        # The holder answered, but not as the protocol says (bytes it was not asked for, a
        # miscounted end) or with an ERROR frame: a bug or a hostile holder, not the
        # network; a connection cut mid-frame is the network's.
        log.error("REFUSED %s's answer: %s", holder, exc)
        return f"protocol: {exc}"
    return f"unreachable: {exc}"


#: A holder's failures (Refused, NoAddress and ConnectionLost are ReplicationErrors).
_EXPECTED = (ReplicationError, SnapshotError, OSError)


def fetch_shard(job: str, rank: int, version: Version | None, into: Any, *, me: str,
                holders: Sequence[str], connections: Connections, own: Sequence[SlotStore],
                clock: Clock, stripe_bytes: int | None = None,
                rates: LinkRates | None = None,
                select: Callable[[SnapshotHeader], Sequence[int]] | None = None,
                reserve: Callable[[int, int], None] | None = None,
                described: tuple[Descriptor, SnapshotHeader] | None = None
                ) -> FetchResult:
    """Fetches and verifies one shard: from this node's own memory when it holds it, else
    striped across every remote holder of one version at once.

    The first remote holder that answers describes the snapshot (its version is then asked of
    every holder) and sends its header; the payload (or the blocks ``select`` wants) is split
    into pieces of whole checksum blocks, each one request, and one thread per holder (the
    caller's own thread when there is one holder: the same code) fetches pieces from the
    shared queue over its connection and checks each piece's blocks as it lands. A holder
    that fails (missing, corrupt, unreachable) puts its piece back and stops; the others
    finish. Each block is verified once, when its piece has landed; the header is checked
    against the descriptor at the end.

    Every request to a holder (connect, describe, header, each piece) has a whole-call
    deadline from ``rates`` (floor + slack * bytes / the holder's measured rate): a holder
    frozen or black-holed mid-piece costs at most that deadline, its connection is closed
    (nothing of it lands in the buffer afterwards), it is dropped for this fetch with an
    ``unreachable: ...deadline...`` reason, and its piece goes to the others. Each piece's
    transfer is measured into ``rates``.

    Args:
        into: a writable buffer, or a function given the descriptor that returns one.
        holders: in the order to try (see :func:`holder_order`); ``me`` reads ``own``, the
            slot stores of this node.
        stripe_bytes: the size of the pieces (rounded up to whole checksum blocks); None:
            :func:`stripe_size` of the payload and the holders.
        rates: the measured link rates (shared across fetches, so a later fetch's deadlines
            come from earlier transfers); None: a fresh one, from the default rate.
        select: given the header, the payload blocks to fetch from peers (the rest of the
            buffer is left as it is: only those blocks are valid); None: every block. A copy
            from this node's own memory is always whole.
        reserve: called with each byte range (start, end) of the buffer ``into`` last gave
            before anything is written there (a scratch segment reserves its pages piece by
            piece, each holder's thread its own); its errors are not a holder's: they end
            the fetch.
        described: the descriptor and checked header of the copy, its header bytes already
            in ``into``'s buffer (an earlier call of this function with a ``select`` of no
            block fetched them): no holder is asked to describe it again, and every remote
            holder serves its pieces at once.

    Raises:
        ShardLost: no holder, or no set of holders, could provide an intact copy;
            ``attempts`` says why each one failed.
    """
    started = clock.monotonic()
    rates = rates if rates is not None else LinkRates()
    reserve = reserve or (lambda start, end: None)
    attempts: list[tuple[str, str]] = []
    chosen: list[Any] = []

    def sized(d: Descriptor) -> Any:
        # ``into`` may allocate: call it once per descriptor and remember what it gave.
        if not chosen or chosen[-1][0] != d:
            chosen.append((d, into(d) if callable(into) else into))
        return chosen[-1][1]

    def whole(d: Descriptor) -> Any:
        buf = sized(d)
        reserve(0, d.total_bytes)
        return buf

    if me in holders:
        try:
            d = copy_own(own, job, rank, version, whole)
            if d is not None:  # checked end to end
                view = memoryview(sized(d)).cast("B")[: d.total_bytes]
                verify_payload(view, check_header(view, d, f"copy of {job} rank {rank} from {me}"))
                return FetchResult(me, d, 0, clock.monotonic() - started, (), ((me, 0),))
        except _EXPECTED as exc:
            attempts.append((me, _reason(me, exc, connections)))
    remote = [h for h in holders if h != me]
    for i, holder in enumerate(remote):
        # Described by the first holder that answers; its bytes are then striped across it
        # and every holder after it.
        try:
            d, header, wire = described + (0,) if described is not None else _describe(
                job, rank, version, holder, connections, sized, rates, reserve)
        except _EXPECTED as exc:
            attempts.append((holder, _reason(holder, exc, connections)))
            continue
        except BaseException:
            connections.discard(holder)  # ``into`` failed (e.g. no room) mid-request
            raise
        # The header as it was checked (padding to the first block included): the pieces
        # write payload blocks only, so at the end these bytes must still be these.
        checked = bytes(staged(sized(d))[: header.layout.data_offset])
        blocks = None if select is None else select(header)
        wanted = (d.total_bytes - d.header_bytes if blocks is None else
                  sum(header.layout.block_range(b)[1] - header.layout.block_range(b)[0]
                      for b in blocks))
        size = stripe_bytes or stripe_size(wanted, len(remote) - i,
                                           min(rates.rate(h) for h in remote[i:]))
        stripe = _Stripe(job, rank, d, header, sized(d), connections, size, rates, clock,
                         blocks, reserve)
        stripe.wire += wire
        if described is None:
            stripe.served[holder] = header.layout.data_offset
        stripe.run(remote[i:])
        attempts.extend(stripe.attempts)
        if stripe.pieces:
            attempts.extend(stripe.absent)
            break  # every holder failed with ranges left: no intact copy
        # Every payload block was checked once its piece landed, and no holder writes after
        # its piece is done or given back: only the header is left, checked when it came. Its
        # bytes are compared, not parsed again (a second pass over the payload cost ~0.1 s
        # per GiB; a second parse ~1 ms for 300 tensors in 1 GiB).
        if bytes(staged(sized(d))[: len(checked)]) != checked:
            reason = (f"copy of {job} rank {rank} striped from {', '.join(stripe.served)}: "
                      "its header changed after it was checked")
            log.error("REFUSED the striped %s", reason)
            attempts.append((",".join(stripe.served), f"corrupt: {reason}"))
            break
        if attempts:
            log.warning("%s rank %d %s fetched from %s after: %s", job, rank, d.version,
                        ", ".join(stripe.served), "; ".join(f"{h}: {r}" for h, r in attempts))
        most = max(stripe.served, key=stripe.served.__getitem__, default=holder)
        return FetchResult(most, d, stripe.wire, clock.monotonic() - started,
                           tuple(attempts), tuple(stripe.served.items()),
                           tag_checked_bytes=stripe.checked)
    raise ShardLost(job, rank, version, attempts)


def _request(connections: Connections, holder: str, call: Callable[[Any], Any],
             connect_timeout: float | None = None) -> tuple[Any, int]:
    """Runs ``call(client)`` on the pooled connection to ``holder`` (once more on a fresh one
    when a reused connection turns out closed by the peer's idle timeout, but not after a
    missed deadline: the holder stopped answering); returns its result and the bytes
    received."""
    client, reused = connections.get(holder, connect_timeout)
    for retry in (reused, False):
        before = client.channel.bytes_received
        try:
            return call(client), client.channel.bytes_received - before
        except DeadlineExceeded:
            raise
        except ConnectionLost:
            if not retry:
                raise
            connections.discard(holder, client)
            client, _ = connections.get(holder, connect_timeout)
    raise AssertionError("unreachable")


def _describe(job: str, rank: int, version: Version | None, holder: str,
              connections: Connections, sized: Callable[[Descriptor], Any], rates: LinkRates,
              reserve: Callable[[int, int], None]) -> tuple[Descriptor, SnapshotHeader, int]:
    """The descriptor and checked header of ``holder``'s copy (its header bytes now in the
    buffer ``sized`` gives), and the bytes received."""
    floor = rates.deadline(holder, 0)
    d, wire = _request(connections, holder,
                       lambda c: c.fetch(job, rank, sized, version, byte_range=(0, 0),
                                         deadline=floor), floor)
    reserve(0, d.header_bytes)
    head = rates.deadline(holder, d.header_bytes)
    _, more = _request(connections, holder,
                       lambda c: c.fetch(job, rank, sized, d.version,
                                         byte_range=(0, d.header_bytes), deadline=head), floor)
    view = staged(sized(d))[: d.total_bytes]  # a Scatter's header lands in its staging
    header = check_header(view, d, f"copy of {job} rank {rank} from {holder}")
    gap = header.layout.data_offset - d.header_bytes
    if gap > 0:  # padding before the first block, when the holder counts it out of the header
        reserve(d.header_bytes, header.layout.data_offset)
        wire += _request(connections, holder, lambda c: c.fetch(
            job, rank, view, d.version, byte_range=(d.header_bytes, gap),
            deadline=rates.deadline(holder, gap)), floor)[1]
    return d, header, wire + more


class _Stripe:
    """The payload pieces of one snapshot, fetched from several holders at once."""

    def __init__(self, job: str, rank: int, d: Descriptor, header: SnapshotHeader, buf: Any,
                 connections: Connections, stripe_bytes: int, rates: LinkRates,
                 clock: Clock, blocks: Sequence[int] | None,
                 reserve: Callable[[int, int], None]) -> None:
        self.job, self.rank, self.d, self.header = job, rank, d, header
        self.reserve = reserve
        self.rates, self.clock = rates, clock
        self.view = landing(buf, d.total_bytes)
        self.connections = connections
        lay = header.layout
        per = max(1, -(-stripe_bytes // lay.block_size))  # blocks per piece, at most
        #: Pieces still to fetch, first piece first, each the runs ``(first block, end
        #: block)`` of wanted blocks one request asks for: the wanted blocks (every block by
        #: default) in order, cut into as few pieces of at most ``per`` blocks as it takes, of
        #: equal length (not a short last one: each piece costs a round trip). A partial
        #: copy wants scattered runs (a tensor's rows each): one request for several runs, not
        #: one each (bench/results/restore38/).
        wanted = list(range(lay.num_blocks) if blocks is None else sorted(set(blocks)))
        cuts = -(-len(wanted) // per)
        bounds = [len(wanted) * i // cuts for i in range(cuts + 1)] if cuts else []
        self.pieces: list[list[tuple[int, int]]] = [
            _runs(wanted[a:b], MAX_FETCH_RANGES) for a, b in zip(bounds, bounds[1:])]
        self.pieces.reverse()
        self.in_flight = 0
        self.wire = 0
        self.checked = 0  # bytes checked against their block tags
        self.served: dict[str, int] = {}
        self.attempts: list[tuple[str, str]] = []
        self.absent: list[tuple[str, str]] = []  # holders without the version, asked anyway
        self.fatal: BaseException | None = None
        self.cond = threading.Condition()

    def run(self, holders: Sequence[str]) -> None:
        """Fetches every piece from ``holders`` (a thread each when there are several); on
        return no thread touches the buffer any more. Re-raises an unexpected error."""
        if len(holders) == 1:
            self._work(holders[0])
        else:
            threads = [threading.Thread(target=self._work, args=(h,), daemon=True,
                                        name=f"elasticd-stripe-{h}") for h in holders]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if self.fatal is not None:
            raise self.fatal

    def _piece(self, ranges: list[tuple[int, int]], limit: float, client: Any) -> int:
        """Fetches the bytes of ``ranges`` (``[start, end)`` each) into the buffer in one
        request; returns how many of them were checked against their block tags as they
        landed."""
        before = client.channel.tag_checked_bytes
        client.fetch(self.job, self.rank, self.view, self.d.version, deadline=limit,
                     ranges=[(start, end - start) for start, end in ranges])
        return client.channel.tag_checked_bytes - before

    def _take(self) -> list[tuple[int, int]] | None:
        with self.cond:
            # Wait while another holder still has a piece in flight: it may fail and put it
            # back, and then this holder must take it.
            while not self.pieces and self.in_flight and self.fatal is None:
                self.cond.wait()
            if not self.pieces or self.fatal is not None:
                return None
            self.in_flight += 1
            return self.pieces.pop()

    def _work(self, holder: str) -> None:
        lay, wire, served, tagged = self.header.layout, 0, 0, 0
        try:
            while (piece := self._take()) is not None:
                ranges = [(lay.block_range(first)[0], lay.block_range(end - 1)[1])
                          for first, end in piece]
                size = sum(end - start for start, end in ranges)
                try:
                    for start, end in ranges:
                        self.reserve(start, end)
                except BaseException as exc:
                    # The buffer's fault, not the holder's (its connection stays): it ends the
                    # fetch.
                    with self.cond:
                        self.pieces.append(piece)
                        self.in_flight -= 1
                        self.fatal = self.fatal or exc
                        self.cond.notify_all()
                    return
                try:
                    # A whole-call deadline: a frozen holder keeps its socket open and would
                    # otherwise cost the socket timeout per receive.
                    limit = self.rates.deadline(holder, size)
                    began = self.clock.monotonic()
                    checked, n = _request(self.connections, holder, functools.partial(
                        self._piece, ranges, limit), self.rates.deadline(holder, 0))
                    self.rates.record(holder, n, self.clock.monotonic() - began)
                    wire += n
                    if checked == size:
                        tagged += checked
                    else:
                        # Not every block came with its owner's block tag (a holder that
                        # kept none: a copy adopted after a restart): check them against
                        # the header's checksums. A block that came with one was checked
                        # against it as it landed: that check is the one.
                        for first, end in piece:
                            for i in range(first, end):
                                a, b = lay.block_range(i)
                                data = self.view[a:b]
                                verify_block(self.header, i, data.tobytes()
                                             if isinstance(data, Spans) else data)
                except BaseException as exc:
                    with self.cond:
                        self.pieces.append(piece)
                        self.in_flight -= 1
                        self.cond.notify_all()
                    if not isinstance(exc, _EXPECTED):
                        raise
                    reason = _reason(holder, exc, self.connections)
                    if reason == "missing" and not served:
                        # A placement's holder that never had this version: not a failure
                        # unless no holder can finish (every holder is asked at once now).
                        log.info("%s rank %d: %s does not hold %s", self.job, self.rank,
                                 holder, self.d.version)
                        with self.cond:
                            self.absent.append((holder, reason))
                        return
                    log.warning("%s rank %d: %s failed after serving %d bytes (%s); its ranges "
                                "go to the other holders", self.job, self.rank, holder, served,
                                reason)
                    with self.cond:
                        self.attempts.append((holder, reason))
                    return
                served += size
                with self.cond:
                    self.in_flight -= 1
                    self.cond.notify_all()
        except BaseException as exc:
            self.connections.discard(holder)
            with self.cond:
                self.fatal = self.fatal or exc
                self.cond.notify_all()
        finally:
            with self.cond:
                self.wire += wire
                self.checked += tagged
                if served:
                    self.served[holder] = self.served.get(holder, 0) + served


def _runs(blocks: Sequence[int], most: int) -> list[tuple[int, int]]:
    """``(first, end)`` runs of consecutive blocks in ``blocks`` (ascending), at most ``most``
    of them: past that the rest go in one run from the last run's start (fetched whole, gaps
    included: a request carries at most ``most`` ranges)."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1][1] = b + 1
        elif len(runs) == most:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    return [(first, end) for first, end in runs]


def copy_own(stores: Sequence[SlotStore], job: str, rank: int, version: Version | None,
             sized: Callable[[Descriptor], Any]) -> Descriptor | None:
    """Copies a shard this node holds (in the first of ``stores`` that has it) into the buffer
    ``sized`` returns; None when no store has it."""
    for store in stores:
        view = pinned_view(store, job, rank, version)
        if view is None:
            continue
        try:
            d = descriptor_of(view)
            memoryview(sized(d)).cast("B")[: d.total_bytes] = view.buffer
            return d
        finally:
            view.release()
    return None


class Fetcher(Protocol):
    """Fetches a shard into a buffer (:meth:`Replicator.fetch`): on return every byte of it
    (every selected block, with ``select``) has been checked against the snapshot's checksums
    (:func:`fetch_shard`'s contract)."""

    def fetch(self, job: str, rank: int, version: Version | None, into: Any,
              select: Callable[[SnapshotHeader], Sequence[int]] | None = None,
              reserve: Callable[[int, int], None] | None = None) -> FetchResult:
        ...


def fetch_into_store(fetcher: Fetcher, store: SlotStore, job: str, rank: int,
                     version: Version | None) -> FetchResult:
    """Fetches a shard into a slot reserved in ``store`` and completes it, so the shard becomes
    that store's latest snapshot of (job, rank).

    Raises:
        ShardLost: from ``fetcher``. OverBudget, SlotBusy: the store has no room.
    """
    slots: list[Any] = []

    def into(d: Descriptor) -> memoryview:
        slots.append(store.reserve(job, rank, d.total_bytes, both=False))
        return slots[-1].buffer

    result = fetcher.fetch(job, rank, version, into)
    slot = slots[-1]
    header = parse_header(slot.buffer, job=job, rank=rank, where=f"{job} rank {rank} fetched")
    # fetch_shard checked every block as it landed (or the whole copy from this node's
    # memory); a second pass here cost ~0.05 s per 385 MB on the restore's path.
    store.complete(slot, header, verified=True)
    return result


def fetch_into_scratch(fetcher: Fetcher, store: SlotStore, job: str, rank: int,
                       version: Version | None, need: Any) -> FetchResult:
    """Fetches from peers only the blocks of a shard that hold the rows ``need`` names (a new
    rank's local boxes, :func:`elasticd.recovery.ranges.parse_boxes`) into a scratch segment
    of ``store``, which the result carries (``scratch``; the caller drops it). The copy is
    partial, so it never becomes a snapshot of the store; from this node's own memory the
    copy is whole.

    Raises:
        ValueError: ``need`` is malformed. ShardLost: from ``fetcher``. OverBudget: no room.
    """
    from elasticd.recovery.ranges import needed_blocks, parse_boxes

    boxes = parse_boxes(need)
    segments: list[Any] = []

    def into(d: Descriptor) -> memoryview:
        # The segment kept from this rank's last partial copy first: its pages are touched
        # where this copy's blocks land.
        segments.append(store.scratch.new(d.total_bytes, job=job, of=rank))
        return segments[-1].view

    def reserve(start: int, end: int) -> None:
        try:
            segments[-1].reserve_range(start, end)
        except OSError as exc:
            raise OverBudget(f"no room for a partial copy of {job} rank {rank}: {exc}") from exc

    try:
        result = fetcher.fetch(job, rank, version, into,
                               select=lambda header: needed_blocks(header, boxes),
                               reserve=reserve)
    except BaseException:
        for segment in segments:
            store.scratch.drop(segment)
        raise
    for segment in segments[:-1]:  # described again by another holder: only the last is used
        store.scratch.drop(segment)
    return dataclasses.replace(result, scratch=segments[-1])

"""The GPU snapshot path: device-to-host copies on a side stream into pinned memory.

:meth:`CudaCopier.start`, called on the training thread right after the optimizer step, makes a
side stream wait for the compute stream (so the copies see every write the step enqueued), then
enqueues one asynchronous copy per tensor on the side stream into a pinned host staging buffer
laid out like the snapshot, and records an event on the side stream. It returns at once: the
GPU copies overlap the next forward and backward. Two waits, each on that event only — never on
the whole device:

* before the optimizer next changes the state, :meth:`CudaCopyHandle.before_mutation` (called by
  the checkpointer's optimizer step pre-hook) makes the *compute stream* wait for the event: the
  host does not block at all;
* a background thread waits for the event on the host, then copies the staged bytes into the
  shared-memory slot; :meth:`CudaCopyHandle.wait` waits for that.

CUDA calls go through a small :class:`DeviceApi` so that tests on a CPU-only machine can check
the ordering with fake streams and events. Worker side: imports torch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch

from elasticd.checkpoint.copier import Copier, CopyHandle, FutureHandle, _check
from elasticd.checkpoint.format import ALIGNMENT, Layout, byte_view


class DeviceApi(Protocol):
    """The CUDA operations the copier uses."""

    def current_stream(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def new_event(self) -> Any: ...
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager: ...
    def pinned(self, nbytes: int) -> torch.Tensor: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None: ...


class TorchCuda:
    """:class:`DeviceApi` on ``torch.cuda`` for the current device."""

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        dst.copy_(src, non_blocking=True)
        if src.is_cuda:
            # The caching allocator must not hand src's memory to the compute stream while
            # the side stream still reads it.
            src.record_stream(stream)


def _runs(lay: Layout) -> Iterator[tuple[int, int]]:
    """Byte ranges covering the layout's entries, merged across alignment padding only."""
    start = end = None
    for e in lay.entries:
        if not e.nbytes:
            continue
        if start is not None and e.offset - end < ALIGNMENT:
            end = e.offset + e.nbytes
            continue
        if start is not None:
            yield start, end
        start, end = e.offset, e.offset + e.nbytes
    if start is not None:
        yield start, end


class CudaCopyHandle(FutureHandle):
    """A snapshot copy in flight on the side stream, then into the slot."""

    def __init__(self, api: DeviceApi, event: Any, future: concurrent.futures.Future) -> None:
        super().__init__(future)
        self._api, self.event = api, event

    def before_mutation(self) -> None:
        """Orders the compute stream after the copies (device-side; the host does not wait)."""
        self._api.current_stream().wait_event(self.event)


class CudaCopier(Copier):
    """Copies (CUDA) tensors into a snapshot buffer through a side stream and pinned memory.

    Args:
        api: the CUDA operations (default: :class:`TorchCuda`).
    """

    def __init__(self, api: DeviceApi | None = None) -> None:
        self.api = api or TorchCuda()
        self.stream = self.api.new_stream()
        self._staging: torch.Tensor | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="elasticd-d2h")

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        # One pinned buffer, grown when needed: pinning is slow, so it is kept between
        # snapshots (the next start() comes only after the previous handle was waited for).
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = self.api.pinned(nbytes)
        return self._staging

    def start(self, tensors: Sequence[torch.Tensor], buffer: Any, lay: Layout) -> CopyHandle:
        view = byte_view(buffer)
        _check(tensors, lay, len(view))
        staging = self._staging_for(lay.total_size)
        self.stream.wait_stream(self.api.current_stream())
        with self.api.use_stream(self.stream):
            for t, e in zip(tensors, lay.entries):
                if e.nbytes:
                    dst = staging[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape)
                    self.api.copy(dst, t.detach(), self.stream)
            event = self.api.new_event()
            event.record(self.stream)
        host = staging.numpy()
        slot = np.frombuffer(view, dtype=np.uint8, count=lay.total_size)

        def to_slot() -> None:
            event.synchronize()  # this event only, on a background thread
            for a, b in _runs(lay):
                slot[a:b] = host[a:b]

        return CudaCopyHandle(self.api, event, self._pool.submit(to_slot))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

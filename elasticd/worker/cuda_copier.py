"""The GPU snapshot path: device-to-host copies on a side stream into pinned memory.

:meth:`CudaCopier.start`, called on the training thread right after the optimizer step, makes a
side stream wait for the compute stream (so the copies see every write the step enqueued), then
enqueues one asynchronous copy per tensor on the side stream and records an event on the side
stream. The copies go straight into the shared-memory slot: the slot's mapping is registered as
pinned memory (``cudaHostRegister`` through torch's cudart binding, once per mapping, undone
before the worker unmaps it), so the DMA engine writes the snapshot where the daemon reads it,
with no staging buffer and no host copy. Where registration fails (an old driver, a locked
memory limit), the copier says so once and falls back to a pinned staging buffer laid out like
the snapshot, copied into the slot on a background thread. It returns at once: the GPU copies
overlap the next forward and backward. Two waits, each on that event only — never on the whole
device:

* before the optimizer next changes the state, :meth:`CudaCopyHandle.before_mutation` (called by
  the checkpointer's optimizer step pre-hook) makes the *compute stream* wait for the event: the
  host does not block at all;
* a background thread waits for the event on the host (and, on the fallback, copies the staged
  bytes into the slot); :meth:`CudaCopyHandle.wait` waits for that.

CUDA calls go through a small :class:`DeviceApi` so that tests on a CPU-only machine can check
the ordering with fake streams and events. Worker side: imports torch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from elasticd.worker.copier import Copier, CopyHandle, _check
from elasticd.snapshot.format import ALIGNMENT, Layout, byte_view

log = logging.getLogger(__name__)


class DeviceApi(Protocol):
    """The CUDA operations the copier uses."""

    def current_stream(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def new_event(self) -> Any: ...
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager: ...
    def pinned(self, nbytes: int) -> torch.Tensor: ...
    def register(self, buffer: memoryview) -> torch.Tensor:
        """Pins ``buffer``'s memory for DMA; a uint8 tensor over it (raises on failure)."""
    def unregister(self, host: torch.Tensor) -> None: ...
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

    def register(self, buffer: memoryview) -> torch.Tensor:
        host = torch.frombuffer(buffer, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        # cudaHostRegisterPortable (1): pinned for every CUDA context, as torch's own helper
        # (torch.cuda._pin_memory_utils) registers shared memory.
        err = int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 1))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {host.numel()} bytes failed (cudaError {err})")
        return host

    def unregister(self, host: torch.Tensor) -> None:
        err = int(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))
        if err != 0:
            log.warning("elasticd: cudaHostUnregister failed (cudaError %d)", err)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        dst.copy_(src, non_blocking=True)
        if src.is_cuda:
            # The caching allocator must not hand src's memory to the compute stream while
            # the side stream still reads it.
            src.record_stream(stream)


def _runs(lay: Layout) -> list[tuple[int, int]]:
    """Byte ranges covering the layout's entries, merged across alignment padding only."""
    runs: list[tuple[int, int]] = []
    for e in lay.entries:
        if e.nbytes and runs and e.offset - runs[-1][1] < ALIGNMENT:
            runs[-1] = (runs[-1][0], e.offset + e.nbytes)
        elif e.nbytes:
            runs.append((e.offset, e.offset + e.nbytes))
    return runs


class CudaCopyHandle(CopyHandle):
    """A snapshot copy in flight on the side stream, then into the slot."""

    def __init__(self, api: DeviceApi, event: Any, future: concurrent.futures.Future) -> None:
        super().__init__(future)
        self._api, self.event = api, event

    def before_mutation(self) -> None:
        """Orders the compute stream after the copies (device-side; the host does not wait)."""
        self._api.current_stream().wait_event(self.event)


class CudaCopier(Copier):
    """Copies (CUDA) tensors into a snapshot buffer through a side stream and pinned memory."""

    def __init__(self, api: DeviceApi | None = None) -> None:
        self.api = api or TorchCuda()
        self.stream = self.api.new_stream()
        self._staging: torch.Tensor | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="elasticd-d2h")
        # Slot mappings registered as pinned memory, by id (the entry holds the mapping, so
        # its id is not reused while registered); None once registration failed.
        self._registered: dict[int, tuple[Any, torch.Tensor]] | None = {}

    def _slot(self, buffer: Any) -> torch.Tensor | None:
        """``buffer`` as a pinned uint8 tensor the copies can target, or None (staging)."""
        if self._registered is None:
            return None
        hit = self._registered.get(id(buffer))
        if hit is not None and hit[0] is buffer:
            return hit[1]
        try:
            host = self.api.register(byte_view(buffer))
        except Exception as exc:  # noqa: BLE001 — any failure: the staging path still works
            log.warning("elasticd: cannot pin the snapshot slot for direct GPU copies (%s); "
                        "copying through a pinned staging buffer instead", exc)
            self._registered = None
            return None
        self._registered[id(buffer)] = (buffer, host)
        return host

    def forget(self, buffer: Any) -> None:
        """Unpins ``buffer`` (the worker is about to unmap it)."""
        hit = (self._registered or {}).pop(id(buffer), None)
        if hit is not None:
            self.api.unregister(hit[1])

    def start(self, tensors: Sequence[torch.Tensor], buffer: Any, lay: Layout) -> CopyHandle:
        view = byte_view(buffer)
        _check(tensors, lay, len(view))
        direct = self._slot(buffer)
        if direct is None and (self._staging is None or self._staging.numel() < lay.total_size):
            # One pinned buffer, grown when needed: pinning is slow, so it is kept between
            # snapshots (the next start() comes only after the previous handle was waited for).
            self._staging = self.api.pinned(lay.total_size)
        staging = direct if direct is not None else self._staging
        self.stream.wait_stream(self.api.current_stream())
        with self.api.use_stream(self.stream):
            for t, e in zip(tensors, lay.entries):
                if e.nbytes:
                    dst = staging[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape)
                    self.api.copy(dst, t.detach(), self.stream)
            event = self.api.new_event()
            event.record(self.stream)
        if direct is not None:
            # The copies wrote the slot itself: only the event is left to wait for.
            return CudaCopyHandle(self.api, event, self._pool.submit(event.synchronize))
        host = staging.numpy()
        slot = np.frombuffer(view, dtype=np.uint8, count=lay.total_size)

        def to_slot() -> None:
            event.synchronize()  # this event only, on a background thread
            for a, b in _runs(lay):
                slot[a:b] = host[a:b]

        return CudaCopyHandle(self.api, event, self._pool.submit(to_slot))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for buffer, _ in list((self._registered or {}).values()):
            self.forget(buffer)

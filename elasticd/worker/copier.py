"""Moving tensors into and out of a snapshot buffer, behind a small :class:`Copier` interface.

The copy into shared memory is the only part of a snapshot the training loop may wait for, so
it sits behind an interface with an asynchronous ``start``: the CPU implementation here copies
with ``Tensor.copy_`` (optionally on a background thread, so it overlaps the next forward and
backward), :mod:`~elasticd.worker.cuda_copier` on a side stream. Whoever drives it must call
``wait`` before the optimizer next mutates the state (e.g. from an optimizer step pre-hook).
Worker side: imports torch. Nothing is pickled: bytes go straight from tensor storage into the
buffer.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import threading
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch

from elasticd.snapshot.format import Layout, TensorSpec, byte_view


_VIEWS_KEPT = 4  # two slots x (copied in save, copied in the background)
_views_lock = threading.Lock()


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name for a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The :class:`TensorSpec` of ``tensor`` (raises ValueError for a dtype the format lacks)."""
    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def _check(tensors: Sequence[torch.Tensor], lay: Layout, size: int) -> None:
    if len(tensors) != len(lay.entries):
        raise ValueError(f"{len(tensors)} tensors for a layout of {len(lay.entries)} entries")
    if size < lay.total_size:
        raise ValueError(f"buffer of {size} bytes is smaller than the layout's {lay.total_size}")
    dtypes, shapes = _expected(lay)
    # Whole lists compared (in C) first: this runs on the training thread every snapshot.
    if ([t.dtype for t in tensors] == dtypes and [t.shape for t in tensors] == shapes
            and all(t.layout is torch.strided for t in tensors)):
        return
    for t, e, dtype, shape in zip(tensors, lay.entries, dtypes, shapes):
        if t.dtype is not dtype or t.shape != shape:
            raise ValueError(
                f"tensor for {e.name!r} is {dtype_name(t.dtype)}{tuple(t.shape)}, the layout "
                f"expects {e.dtype}{e.shape}: flatten the state again and recompute the layout"
            )
        if t.layout != torch.strided:
            raise ValueError(f"tensor for {e.name!r} has layout {t.layout}; only dense tensors")


def _cached(cache: collections.OrderedDict, key: Any, held: Any, make: Callable[[], Any]) -> Any:
    """``make()``, kept in ``cache`` for the most recent few keys. The entry holds ``held``, the
    objects whose ids make the key, so those ids are not reused while it is cached."""
    with _views_lock:
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit[1]
    value = make()
    with _views_lock:
        cache[key] = (held, value)
        while len(cache) > _VIEWS_KEPT:
            cache.popitem(last=False)
    return value


_expected_cache: collections.OrderedDict[int, tuple[Layout, Any]] = collections.OrderedDict()


def _expected(lay: Layout) -> tuple[list[torch.dtype], list[torch.Size]]:
    """The torch dtypes and the shapes of ``lay``'s entries, kept for the most recent layouts:
    this check runs on the training thread every step, and dtype names are slow to compare."""
    return _cached(_expected_cache, id(lay), lay, lambda: (
        [getattr(torch, e.dtype) for e in lay.entries], [torch.Size(e.shape) for e in lay.entries]))


def copy_into(tensors: Sequence[torch.Tensor], buffer: Any, lay: Layout) -> None:
    """Copies ``tensors`` (in layout order) into ``buffer`` at the layout's offsets.

    Args:
        tensors: dense tensors of any dtype and strides (non-contiguous ones are packed).
        buffer: a writable buffer of at least ``lay.total_size`` bytes (an mmap, a bytearray,
            a slot's memoryview). The header region is left alone.
        lay: from :func:`elasticd.snapshot.format.layout` over the same tensors.
    """
    _copy_checked(tensors, buffer, _checked_view(tensors, buffer, lay), lay)


def _checked_view(tensors: Sequence[torch.Tensor], buffer: Any, lay: Layout) -> memoryview:
    """``buffer``'s writable bytes, once ``tensors`` are checked against ``lay``."""
    view = byte_view(buffer)
    if view.readonly:
        raise ValueError("a copy needs a writable buffer")
    _check(tensors, lay, len(view))
    return view


def _copy_checked(tensors: Sequence[torch.Tensor], buffer: Any, view: memoryview,
                  lay: Layout) -> None:
    srcs = [t for t, e in zip(tensors, lay.entries) if e.nbytes]
    if not srcs:
        return
    dsts = _views(buffer, view, lay)
    # One call for every tensor: it runs without the GIL, where a loop of copy_ calls took the
    # GIL hundreds of times per snapshot from the thread running forward and backward.
    with torch.no_grad():
        torch._foreach_copy_(dsts, srcs)


_views_cache: collections.OrderedDict[tuple[int, int], tuple[Any, Any]] = collections.OrderedDict()


def _views(buffer: Any, view: memoryview, lay: Layout) -> list[torch.Tensor]:
    """The typed destination tensors of ``lay``'s non-empty entries in ``buffer``: one uint8
    tensor over the buffer, a typed view per entry (writes go straight into shared memory).

    Built once per (buffer, layout) and kept for the most recent few: building them is most of
    the Python time of a snapshot.
    """
    def make() -> list[torch.Tensor]:
        dst = torch.frombuffer(view, dtype=torch.uint8, count=lay.total_size)
        return [_typed(dst, e) for e in lay.entries if e.nbytes]

    return _cached(_views_cache, (id(buffer), id(lay)), (buffer, lay), make)


def forget_views(buffer: Any) -> None:
    """Drops the cached views of ``buffer`` (before unmapping it)."""
    with _views_lock:
        for key in [k for k, v in _views_cache.items() if v[0][0] is buffer]:
            del _views_cache[key]


def read_tensors(buffer: Any, lay: Layout) -> list[torch.Tensor]:
    """New CPU tensors holding copies of every entry of ``buffer`` (in layout order).

    Copies, because the buffer is a slot that the store will reuse for a later snapshot and
    ``Optimizer.load_state_dict`` keeps the tensors it is given.
    """
    view = byte_view(buffer)
    if len(view) < lay.total_size:
        raise ValueError(f"buffer of {len(view)} bytes is smaller than the layout's {lay.total_size}")
    out = []
    for e in lay.entries:
        t = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
        if e.nbytes:
            # Through numpy's byte view: works for read-only buffers and for dtypes numpy lacks.
            t.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(
                view, dtype=np.uint8, count=e.nbytes, offset=e.offset
            )
        out.append(t)
    return out


def tensor_views(buffer: Any, lay: Layout) -> list[torch.Tensor]:
    """Tensors over every entry of ``buffer`` (in layout order), without a copy: valid while
    ``buffer`` is, and never to be written (a read-only mapping of a slot) nor kept past it.
    """
    view = byte_view(buffer)
    if len(view) < lay.total_size:
        raise ValueError(f"buffer of {len(view)} bytes is smaller than the layout's "
                         f"{lay.total_size}")
    if not lay.total_size:
        return [torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in lay.entries]
    with warnings.catch_warnings():
        # torch warns that writing into a read-only buffer is undefined; nothing writes.
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(view, dtype=torch.uint8, count=lay.total_size)
    return [_typed(whole, e) if e.nbytes else torch.empty(e.shape, dtype=getattr(torch, e.dtype))
            for e in lay.entries]


def _typed(whole: torch.Tensor, e: Any) -> torch.Tensor:
    """Entry ``e`` of a layout as a typed tensor over ``whole`` (the buffer's bytes)."""
    return whole[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)


class CopyHandle:
    """A copy in flight on an executor (the CPU and CUDA copiers')."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the copy is done; re-raises its error; TimeoutError after ``timeout``."""
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            raise TimeoutError(f"snapshot copy still running after {timeout} s") from exc

    def done(self) -> bool:
        """True once the copy has finished (successfully or not)."""
        return self._future.done()


class Copier(abc.ABC):
    """Copies a flattened state into a snapshot buffer."""

    @abc.abstractmethod
    def start(self, tensors: Sequence[torch.Tensor], buffer: Any, lay: Layout) -> CopyHandle:
        """Starts copying ``tensors`` into ``buffer``; the tensors must not change until
        :meth:`CopyHandle.wait` returns."""

    def forget(self, buffer: Any) -> None:
        """``buffer`` is about to be unmapped: drop anything held on it (pinning)."""

    def close(self) -> None:
        """Releases threads or streams."""


class CpuCopier(Copier):
    """Copies host tensors with ``Tensor.copy_``.

    Args:
        background: copy on one background thread (``copy_`` releases the GIL), so that the
            copy overlaps the next forward/backward; otherwise ``start`` copies before returning.
    """

    def __init__(self, background: bool = False) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="elasticd-copy") if background else None

    def start(self, tensors: Sequence[torch.Tensor], buffer: Any, lay: Layout) -> CopyHandle:
        # Bad input fails here, not in the thread, and is checked once: the check holds the
        # GIL, which a check on the copy thread would take from the training loop.
        view = _checked_view(tensors, buffer, lay)
        if self._pool is None:
            _copy_checked(tensors, buffer, view, lay)
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return CopyHandle(done)
        return CopyHandle(self._pool.submit(_copy_checked, list(tensors), buffer, view, lay))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

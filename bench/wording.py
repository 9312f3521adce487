"""How benchmarks put a figure beside its baseline in words, so that the words match the numbers.

``0.9x faster`` read as faster; :func:`speed` says ``1.1x slower`` instead. Benchmarks import
it as a sibling module (``bench/`` is on ``sys.path`` when one of them runs).
"""

from __future__ import annotations

#: Within this factor of each other, two times are "about as fast".
SAME = 1.05


def speed(seconds: float, baseline_seconds: float, baseline: str) -> str:
    """``seconds`` against ``baseline_seconds`` (lower is better), in words.

    >>> speed(1.0, 2.0, "torch.load")
    '2.0x faster than torch.load'
    >>> speed(1.0, 0.9, "torch.load")
    '1.1x slower than torch.load'
    >>> speed(1.0, 1.02, "torch.load")
    'about as fast as torch.load (within 5 %)'
    """
    if seconds <= 0 or baseline_seconds <= 0:
        raise ValueError(f"times must be positive, got {seconds!r} and {baseline_seconds!r}")
    ratio = baseline_seconds / seconds
    if ratio >= SAME:
        return f"{ratio:.1f}x faster than {baseline}"
    if ratio <= 1 / SAME:
        return f"{1 / ratio:.1f}x slower than {baseline}"
    return f"about as fast as {baseline} (within {round((SAME - 1) * 100)} %)"

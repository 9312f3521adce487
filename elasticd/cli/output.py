"""One output function for every ``elasticctl`` command and format.

``pretty`` is a plain aligned table for people; ``json`` is the same data with stable keys for
scripts, and nothing decorative. Neither leaves a control character of the data raw: most of
what is shown came from workers, peers or etcd writers (:mod:`elasticd.printable`).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from elasticd.printable import printable_data


class Table:
    """Columns as (header, key) pairs. A cell longer than ``max_width`` is cut, except in the
    last column: nothing follows it to keep aligned, so it is shown whole (a sentence)."""

    def __init__(self, columns: Sequence[tuple[str, str]], max_width: int = 60) -> None:
        self.columns = list(columns)
        self.max_width = max_width

    def _cell(self, value: Any, whole: bool = False) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.2f}"
        text = str(value)
        return text if whole or len(text) <= self.max_width else text[: self.max_width - 1] + "…"

    def render(self, rows: Sequence[dict[str, Any]]) -> str:
        if not rows:
            return "(none)"
        last = len(self.columns) - 1
        cells = [[self._cell(r.get(k), whole=i == last) for i, (_, k) in enumerate(self.columns)]
                 for r in rows]
        heads = [h for h, _ in self.columns]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
        widths[last] = 0  # never padded
        lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        return "\n".join(lines)


def emit(data: Any, fmt: str, pretty: "Table | Callable[[Any], str]",
         one_line: bool = False) -> str:
    """Renders ``data`` (a list of row dicts, or a document) in ``fmt``.

    Every string of ``data`` is shown escaped: in JSON by JSON's own escapes, which give the
    exact value back to a script (with ``ensure_ascii``, the default, everything outside
    printable ASCII is a ``\\u`` escape), and for people by
    :func:`~elasticd.printable.printable`, before the table or text is laid out.

    Args:
        pretty: a :class:`Table` for lists of rows, or a function rendering a document.
        one_line: JSON on a single line (``--watch`` prints one document per line).
    """
    if fmt == "json":
        return json.dumps(data, indent=None if one_line else 2, sort_keys=True)
    data = printable_data(data)
    return pretty.render(data) if isinstance(pretty, Table) else pretty(data)

"""Text from others made safe to show: the one escaping rule for terminals and log lines.

Much of what ``elasticctl`` prints and the daemon logs was written by someone else: a worker's
``register`` text and the exception lines of its crash, an etcd record's event detail, a node's
sentence or host name, a job spec's script path. Whoever wrote it may have put terminal control
sequences in it (an ``ESC ]`` that retitles the operator's window or rewrites what is on the
screen, a carriage return that hides the rest of a line) or a newline that forges a log line of
its own. So every such text passes through :func:`printable` where it leaves the program: the
CLI's one output function (:func:`elasticd.cli.output.emit`) and its error line, and the
daemon's log formatter (:class:`PrintableFormatter`), and the status line it sends systemd.
JSON needs nothing more than its own escapes (``json.dumps`` with ``ensure_ascii``, the
default, escapes everything outside printable ASCII).

What is escaped: C0 and C1 control characters and DEL (``\\x1b``), the Unicode characters that
reorder or hide text (bidi overrides and isolates, zero-width characters, line and paragraph
separators, the BOM: ``\\u202e``), and lone surrogates, which an encoder would refuse (a crash
of the print, not a display problem). Everything else, backslashes included, is shown as it is.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any

__all__ = ["PrintableFormatter", "printable", "printable_data"]

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
                     "\u2060-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff]")


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal or a log reader would act on escaped
    (``"\\x1b[2J"`` becomes ``"\\\\x1b[2J"``); text without one is returned as it is."""
    return _UNSAFE.sub(_escape, text)


def printable_data(value: Any) -> Any:
    """``value`` (a JSON-like document: dicts, lists, strings, numbers) with :func:`printable`
    applied to every string in it, keys included; other values are returned as they are."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_data(k): printable_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_data(v) for v in value]
    return value


class PrintableFormatter(logging.Formatter):
    """A log formatter whose every line is :func:`printable`: a message cannot carry a
    terminal sequence or a newline (a forged record of its own). A traceback keeps its lines,
    each escaped; an exception's message in it is one line, as a log message is."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 — logging's name
        return printable(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:  # noqa: N802
        out = []
        for chunk in traceback.TracebackException(ei[0], ei[1], ei[2]).format():
            body = chunk[:-1] if chunk.endswith("\n") else chunk
            if chunk.startswith(("Traceback", "  ", "\n")):  # headers and frames: our lines
                out.append(_lines(body))
            else:  # an exception's message: it may quote anything, newlines included
                out.append(printable(body))
        return "\n".join(out)

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return _lines(super().formatStack(stack_info))


def _lines(text: str) -> str:
    return "\n".join(printable(line) for line in text.split("\n"))

"""The options every ``elasticctl`` command shares, and how bad input is reported.

The cluster options (``--etcd``, ``--prefix``, the etcd TLS/auth flags, ``--etcd-timeout``)
and the output options (``--format``, ``--watch``) are accepted before the command, as README
and ``--help`` show them (``elasticctl --etcd HOST:PORT nodes``), and after it (``elasticctl
nodes --etcd HOST:PORT``); given in both places, the later one wins. Unset, the cluster options
fall back to ``ELASTICD_ETCD``, ``ELASTICD_PREFIX``, ... and then to their defaults.

Every number is checked when it is parsed: not a number, not finite (``nan``, ``inf``) or out
of range is bad usage (exit 2) in one line saying what to give instead. Every parse error is one
line too (:class:`Parser`), not argparse's usage block.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable, NoReturn, Sequence

from elasticd.cli.errors import EXIT_USAGE, UsageError

#: (flag, metavar, default when neither the flag nor the environment gives one, help). Each
#: reads ``ELASTICD_<NAME>`` when the flag is not given.
CLUSTER_FROM_ENV: Sequence[tuple[str, str, str, str]] = (
    ("--etcd", "HOST:PORT", "", "HOST:PORT[,HOST:PORT...] of etcd (env ELASTICD_ETCD)"),
    ("--prefix", "PREFIX", "/elasticd",
     "cluster key prefix (env ELASTICD_PREFIX, default /elasticd)"),
    ("--etcd-user", "USER", "", "etcd user (env ELASTICD_ETCD_USER)"),
    ("--etcd-password", "PASSWORD", "",
     "etcd password; prefer the env ELASTICD_ETCD_PASSWORD (flags show in ps)"),
    ("--etcd-ca-cert", "FILE", "",
     "CA certificate (PEM) for TLS to etcd (env ELASTICD_ETCD_CA_CERT)"),
    ("--etcd-cert", "FILE", "",
     "client certificate (PEM) for TLS to etcd (env ELASTICD_ETCD_CERT)"),
    ("--etcd-key", "FILE", "", "key of --etcd-cert (env ELASTICD_ETCD_KEY)"),
)
#: Defaults of the shared options that read no environment variable.
DEFAULTS: dict[str, Any] = {"etcd_timeout": 2.0, "format": "pretty", "watch": None}

ETCD_TIMEOUT_RANGE = (0.1, 600.0)
WATCH_RANGE = (0.1, 86400.0)
#: The TLS files: what each must hold (for the message), its PEM kind and the line it needs.
TLS_FILES = {
    "etcd_ca_cert": ("the CA certificate (PEM) that signed etcd's server certificate",
                     "certificate", b"-----BEGIN CERTIFICATE-----"),
    "etcd_cert": ("this client's certificate (PEM)", "certificate",
                  b"-----BEGIN CERTIFICATE-----"),
    "etcd_key": ("the private key (PEM) of --etcd-cert", "private key", b"PRIVATE KEY-----"),
}
#: Larger than any certificate chain or key file elasticd is given.
_PEM_MAX = 1 << 20


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the help to read, exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"elasticctl: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


# -- numbers ------------------------------------------------------------------------------


def _finite(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of {unit}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of {unit}")
    return value


def seconds(low: float, high: float, default: float | None = None,
            low_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of seconds in [low, high] ((low, high] with
    ``low_open``)."""

    def parse(text: str) -> float:
        value = _finite(text, "seconds")
        if value > high or value < low or (low_open and value == low):
            lower = f"more than {low:g}" if low_open else f"{low:g}"
            hint = f" (default {default:g})" if default is not None else ""
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: use {lower} to {high:g} seconds{hint}")
        return value

    return parse


def whole(low: int, high: int, what: str = "") -> Callable[[str], int]:
    """An argparse ``type``: a whole number in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: use {low} to {high}{' ' + what if what else ''}")
        return value

    return parse


def finite(unit: str) -> Callable[[str], float]:
    """An argparse ``type``: any finite number (the range is checked where it is used)."""
    return lambda text: _finite(text, unit)


# -- the shared options -------------------------------------------------------------------


def add_shared(parser: argparse.ArgumentParser, after_command: bool) -> None:
    """Adds the shared options to ``parser``: the top-level one (``after_command`` False) or
    the parent of every command's parser.

    Neither place sets a value unless the option is given (None at the top, absent after the
    command), so a value before the command survives the command's parser and
    :func:`resolve` fills in the environment and the defaults afterwards.
    """
    default = argparse.SUPPRESS if after_command else None
    g = parser.add_argument_group("cluster (before or after the command)")
    for flag, metavar, _, text in CLUSTER_FROM_ENV:
        g.add_argument(flag, metavar=metavar, default=default, help=text)
    low, high = ETCD_TIMEOUT_RANGE
    g.add_argument("--etcd-timeout", type=seconds(low, high, DEFAULTS["etcd_timeout"]),
                   default=default, metavar="SECONDS",
                   help=f"seconds one etcd request may take ({low:g} to {high:g}, "
                        f"default {DEFAULTS['etcd_timeout']:g})")
    o = parser.add_argument_group("output (before or after the command)")
    o.add_argument("--format", choices=("pretty", "json"), default=default,
                   help="pretty (default) for people, json for scripts")
    o.add_argument("--watch", type=seconds(*WATCH_RANGE), metavar="SECONDS", default=default,
                   help="refresh every SECONDS until interrupted (commands that only read)")


def resolve(args: argparse.Namespace, environ: Any = None) -> argparse.Namespace:
    """Fills in the shared options not given: from the environment, then the defaults.
    Records where each cluster option came from in ``args.sources`` (for messages)."""
    environ = os.environ if environ is None else environ
    sources: dict[str, str] = {}
    for flag, _, fallback, _ in CLUSTER_FROM_ENV:
        dest = flag.lstrip("-").replace("-", "_")
        env = "ELASTICD_" + dest.upper()
        if getattr(args, dest, None) is not None:
            sources[dest] = flag
        elif env in environ:
            setattr(args, dest, environ[env])
            sources[dest] = env
        else:
            setattr(args, dest, fallback)
            sources[dest] = "default"
    for dest, fallback in DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, fallback)
    args.sources = sources
    return args


def check_tls_files(args: argparse.Namespace) -> None:
    """The TLS files exist, are readable, and come in a combination etcd can use."""
    where = args.sources.get
    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise UsageError("--etcd-cert and --etcd-key go together: give both (a client "
                         "certificate and its key) or neither")
    if args.etcd_cert and not args.etcd_ca_cert:
        raise UsageError("--etcd-cert needs --etcd-ca-cert too: give the CA certificate that "
                         "signed etcd's server certificate")
    for dest, (what, kind, marker) in TLS_FILES.items():
        path = getattr(args, dest)
        if not path:
            continue
        try:
            with open(path, "rb") as fh:
                head = fh.read(_PEM_MAX)
        except OSError as exc:
            why = (exc.strerror or str(exc)).lower()
            raise UsageError(f"{where(dest)} {path!r}: {why}: give the path of {what}") from exc
        if marker not in head:
            # gRPC would print its own multi-line errors and then fail to connect.
            raise UsageError(f"{where(dest)} {path!r}: not a PEM {kind}: give the path of "
                             f"{what}")

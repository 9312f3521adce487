"""One exception root: every error class elasticd defines is an :class:`ElasticdError`, and the
family roots keep the standard bases existing ``except`` clauses rely on."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import elasticd
from elasticd.errors import ElasticdError

#: The rendezvous modules, which issue 17 (the etcd-native rendezvous) replaces, are left out.
RENDEZVOUS = "elasticd.coordination.rendezvous"

#: Family roots whose standard base callers catch (``except ValueError``, ...).
STANDARD_BASES = {
    "elasticd.agent.job_files.UnsafeJobFile": OSError,
    "elasticd.checkpoint.restore.RestoreError": RuntimeError,
    "elasticd.cluster.jobspec.JobSpecError": ValueError,
    "elasticd.config.ConfigError": ValueError,
    "elasticd.config.SecretFileError": ValueError,
    "elasticd.coordination.embedded.EtcdNotFound": RuntimeError,
    "elasticd.coordination.embedded.EtcdStartError": RuntimeError,
    "elasticd.coordination.records.RecordError": ValueError,
    "elasticd.daemon.daemon.NodeIdInUse": RuntimeError,
    "elasticd.local.wire.FrameError": ValueError,
    "elasticd.replication.placement.PlacementError": ValueError,
}


def _errors() -> dict[str, type]:
    out = {}
    for info in pkgutil.walk_packages(elasticd.__path__, "elasticd."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == info.name:
                out[f"{info.name}.{cls.__qualname__}"] = cls
    return out


def test_every_error_elasticd_defines_is_an_elasticd_error():
    errors = _errors()
    assert len(errors) > 50  # the walk found the package's errors
    outside = [n for n, cls in errors.items()
               if not issubclass(cls, ElasticdError) and not n.startswith(RENDEZVOUS)]
    assert outside == []


def test_family_roots_keep_their_standard_bases():
    errors = _errors()
    for name, base in STANDARD_BASES.items():
        assert issubclass(errors[name], base), name
    err = errors["elasticd.agent.job_files.UnsafeJobFile"](13, "Permission denied")
    assert (err.errno, err.strerror) == (13, "Permission denied")

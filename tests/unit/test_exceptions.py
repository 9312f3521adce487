"""One exception root: every exception class elasticd defines derives from ``ElasticdError``.

Walks every module of the package, imports it, and checks each exception class defined there
(not the ones it imports). The rendezvous' errors derive from torch's rendezvous errors too.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import elasticd
from elasticd.errors import CheckpointError, ElasticdError, InputError, LocalProtocolError, NodeError



def _defined_exceptions():
    for info in pkgutil.walk_packages(elasticd.__path__, "elasticd."):
        module = importlib.import_module(info.name)  # a module that fails to import fails here
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__):
                yield module.__name__, name, obj


def test_every_exception_derives_from_elasticd_error():
    found = list(_defined_exceptions())
    outside = [f"{mod}.{name}" for mod, name, cls in found
               if not issubclass(cls, ElasticdError)]
    assert not outside, "not under ElasticdError: " + ", ".join(outside)
    # The walk reached the package's exceptions (about 70 when this test was written).
    assert len(found) > 60, len(found)


def test_exceptions_keep_the_builtin_bases_callers_catch():
    from elasticd.agent.job_files import UnsafeJobFile
    from elasticd.worker.restore import RestoreError
    from elasticd.worker.state import UnsupportedValue
    from elasticd.config import ConfigError
    from elasticd.coordination.records import CorruptRecord
    from elasticd.local.wire import FrameError, RequestError
    from elasticd.worker.client import DaemonTimeout

    assert issubclass(UnsafeJobFile, OSError) and issubclass(UnsafeJobFile, NodeError)
    assert issubclass(RestoreError, RuntimeError) and issubclass(RestoreError, CheckpointError)
    assert issubclass(UnsupportedValue, TypeError) and issubclass(UnsupportedValue, CheckpointError)
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, InputError)
    assert issubclass(CorruptRecord, ValueError) and issubclass(CorruptRecord, InputError)
    assert issubclass(FrameError, ValueError) and issubclass(FrameError, LocalProtocolError)
    assert issubclass(RequestError, LocalProtocolError)
    assert issubclass(DaemonTimeout, LocalProtocolError)
    # An OSError subclass still builds and prints as one.
    exc = UnsafeJobFile(40, "Too many levels of symbolic links")
    assert exc.errno == 40 and "symbolic links" in str(exc)


def test_import_elasticd_offers_the_root():
    assert elasticd.ElasticdError is ElasticdError

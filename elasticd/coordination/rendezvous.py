"""The ``torchrun.handlers`` entry points' import path (``pyproject.toml``), kept stable.

The rendezvous lives in :mod:`elasticd.rendezvous` (the handler, its rounds, its store); this
module only re-exports what the entry points and :mod:`elasticd.agent.torchrun` name, so that an
installed ``etcd-v3 = "elasticd.coordination.rendezvous:handler_creator"`` keeps working.
"""

from elasticd.rendezvous.plugin import (
    BACKEND_NAME,
    NATIVE_BACKEND_NAME,
    handler_creator,
    native_handler_creator,
    on_handler_created,
)

__all__ = ["BACKEND_NAME", "NATIVE_BACKEND_NAME", "handler_creator", "native_handler_creator",
           "on_handler_created"]

"""The ``etcd-v3`` torchrun rendezvous: ``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=H:P``.

torch ships no rendezvous on the etcd v3 API (its ``etcd`` and ``etcd-v2`` backends need the v2
API, gone in etcd 3.6). This module plugs elasticd's own in through the ``torchrun.handlers``
entry point: torch calls :func:`handler_creator` with no arguments and registers the creator it
returns under the entry point's name. The creator builds
:class:`~elasticd.rendezvous.handler.EtcdNativeRendezvousHandler` from
``--rdzv-endpoint`` and ``--rdzv-conf`` (:mod:`.config`): per-node JSON records
bound to each agent's etcd lease, one elected closer that closes each round with one
compare-and-set, watches instead of polls, no pickle (the rules are in :mod:`.rounds`). Everything lives under
``<prefix>/jobs/<run_id>/rdzv/``. The same handler is also registered as ``etcd-v3-native``,
the name it had before it replaced torch's dynamic rendezvous behind ``etcd-v3``.

Decisions, and why (numbers from docs/facts.md and docs/scale.md):

* **Outage grace.** Every etcd write retries on an unreachable etcd for ``etcd_grace_period``
  seconds (default 30) before raising ``RendezvousConnectionError``, because torch's agent ends
  the job on any rendezvous error; ``num_nodes_waiting()``, which it calls while workers train,
  reads the watch's mirror and cannot fail.
* **No shared agent TCPStore.** ``use_agent_store`` is False: restarted workers host their own
  TCPStore at the rank-0 node (docs/facts.md, "Shared TCPStore").
* **A node's duties under a daemon** (fencing itself for a silent daemon, restarting its
  workers when a member of their round is gone) are added by :mod:`elasticd.agent.torchrun`,
  through which the daemons start torchrun, with :data:`on_handler_created`: this module
  imports nothing from ``elasticd.agent``.
* **Restartable agents.** torch's agent closes the rendezvous for good when it ends, also with
  an error. elasticd's daemons pass ``close_on_failure=false``: an agent that fails leaves the
  rendezvous open, so the agent its daemon restarts (and every other node's) can join again.

Security: records are JSON with a schema version, and a record this code cannot read is
ignored (a node's) or reported (the round's); nothing read from etcd is unpickled. Whoever can
write ``<prefix>/jobs/*/rdzv/`` can still disturb the job's rounds: run etcd with
authentication (TLS client certificates, or etcd users with the password in
``ELASTICD_ETCD_PASSWORD`` rather than on the command line).

This module runs in the torchrun agent, never in the daemon. It imports torch only when a handler
is created: importing torch's rendezvous package loads every ``torchrun.handlers`` entry point,
this module included, so a torch import at the top would be circular whenever this module is
imported first (torch then logs a warning and leaves etcd-v3 unregistered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousParameters

    from elasticd.rendezvous.handler import EtcdNativeRendezvousHandler

__all__ = ["BACKEND_NAME", "NATIVE_BACKEND_NAME", "handler_creator", "native_handler_creator",
           "on_handler_created"]

#: Backend name: the entry point's name, and what the handler's get_backend() returns.
BACKEND_NAME = "etcd-v3"
#: The same handler's former name (registered too, so that existing command lines still run).
NATIVE_BACKEND_NAME = "etcd-v3-native"
#: Called with every handler this process creates, before torch uses it. elasticd's daemons
#: start the agent through :mod:`elasticd.agent.torchrun`, which adds a node's duties here;
#: plain torchrun adds nothing.
on_handler_created: list[Callable[[EtcdNativeRendezvousHandler], None]] = []


def handler_creator(name: str = BACKEND_NAME
                    ) -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the creator torch registers.

    Args:
        name: what the handler's ``get_backend()`` returns: the entry point's name.
    """

    def create(params: RendezvousParameters) -> RendezvousHandler:
        from elasticd.rendezvous.handler import create_handler

        handler = create_handler(params, name)
        for hook in on_handler_created:
            hook(handler)
        return handler

    return create


def native_handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``etcd-v3-native`` entry point: the same handler under its former name."""
    return handler_creator(NATIVE_BACKEND_NAME)

"""What the daemon hands a job's torchrun agent: rendezvous settings tuned for fast recovery,
and (when the cluster's etcd has users) the agent's own etcd credentials."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from elasticd.config import Settings
from elasticd.coordination.api import Coordinator
from elasticd.coordination.keys import Keyspace

if TYPE_CHECKING:
    from elasticd.coordination.agent_credentials import AgentCredentials


def rdzv_conf(s: Settings) -> dict[str, str]:
    """torchrun rendezvous settings for this cluster's agents, tuned for fast recovery."""
    return {
        "last_call_timeout": f"{s.rdzv_last_call:g}",
        "etcd_grace_period": f"{s.outage_grace:g}",
        "etcd_timeout": f"{s.etcd_timeout:g}",
        "join_timeout": "900",
        "grow": s.rdzv_grow,
        # A dead node leaves the round when its agent's etcd lease expires (the node's
        # TTL): the join record is bound to that lease (rendezvous/handler.py).
        "liveness_ttl": str(max(2, s.lease_ttl)),
        "liveness_confirm": "0.5",
        # The daemon restarts an agent that died: its error must not close the
        # rendezvous for every node (rendezvous/plugin.py, "Restartable agents").
        "close_on_failure": "false",
    }


def agent_credentials(s: Settings, coord: Coordinator, keys: Keyspace) -> AgentCredentials | None:
    """What gives agents their own etcd credentials and TLS files (None: nothing to give,
    e.g. the embedded etcd)."""
    if not (s.etcd and coord.etcd() is not None and (s.agent_users_on or s.etcd_ca_cert)):
        return None
    from elasticd.coordination.agent_credentials import AgentCredentials

    return AgentCredentials(coord, keys, s.node_id, os.path.join(s.state_path, "agent-etcd"),
                            ca_cert=s.etcd_ca_cert, agent_cert=s.agent_etcd_cert,
                            agent_key=s.agent_etcd_key, users=s.agent_users_on)

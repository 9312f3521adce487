"""The node's start (:class:`elasticd.daemon.node.Node`): what it says when etcd will not take it."""

from __future__ import annotations

import pytest

from elasticd.config import Settings
from elasticd.coordination.api import Refused
from elasticd.coordination.etcd import EtcdCoordinator
from elasticd.daemon.node import Fatal, Node


def test_a_start_etcd_keeps_refusing_names_the_cause_not_the_network(monkeypatch):
    """A daemon started while etcd's users keep changing says so: 'check --etcd and that etcd is
    running' would send the operator after a network that works."""
    def refuse(self, key):
        raise Refused("etcd refused the request: revision of auth store is old")

    monkeypatch.setattr(EtcdCoordinator, "revision", refuse)
    node = Node(Settings(node_id="n1", etcd="http://127.0.0.1:9"))
    try:
        with pytest.raises(Fatal, match="users or roles kept changing"):
            node._connect()
    finally:
        node.close()

"""Shared fixtures: a real etcd server per test session, unique key prefixes, and clients.

Tests that need the real server take the ``etcd`` fixture (marked ``etcd``); it is started once
per session on free loopback ports and stopped at the end. Tests that break etcd (SIGSTOP, kill)
take ``private_etcd`` instead, a server of their own.
"""

from __future__ import annotations

import itertools
import os
import sys
import uuid

import pytest

from elasticd.coordination.embedded import EmbeddedEtcd
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
_counter = itertools.count()


@pytest.fixture(scope="session")
def etcd():
    """A single-member etcd shared by the whole session (tests isolate by prefix)."""
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_etcd():
    """An etcd server for one test, which the test may pause, kill and restart."""
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prefix():
    """A key prefix no other test uses."""
    return f"/t{next(_counter)}-{uuid.uuid4().hex[:8]}"


def connect(server: EmbeddedEtcd, timeout: float = 1.0) -> EtcdCoordinator:
    return EtcdCoordinator(EtcdSettings(parse_endpoints(server.endpoints), timeout=timeout))


@pytest.fixture
def etcd_client(etcd):
    client = connect(etcd)
    try:
        yield client
    finally:
        client.close()

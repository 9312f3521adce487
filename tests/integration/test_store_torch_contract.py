"""torch's own store contract, asked of the etcd-v3 rendezvous store.

These are the checks of ``StoreTestBase`` in torch's ``test/distributed/test_store.py`` (the
suite torch runs against its FileStore, HashStore, TCPStore and PrefixStore), one test each,
under the same names, written here rather than copied; plus ``dist._test_python_store``, torch's
C++ check of a Python store through its trampoline. They run against the store on a real etcd,
on the in-memory fake, and wrapped in torch's ``PrefixStore`` as the agents use it.

Where torch's own test skips a store (the queue tests, when ``queue_push`` raises
``NotImplementedError``: a Python store without queues), this one skips it the same way, with
torch's reason. ``append``, ``multi_get`` and ``multi_set`` are torch's extended API, which
this store offers (``has_extended_api()`` is True, through ``PrefixStore`` too).
torch's ``StoreTestBase`` itself, vendored unchanged from torch 2.6.0, runs in
test_store_torch_vendored.py.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator
from elasticd.rendezvous.store import EtcdV3Store

TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd),
                        pytest.param("etcd+prefix", marks=pytest.mark.etcd)])
def make_store(request, prefix):
    """A factory of stores on one fresh key directory (as torch's ``_create_store``)."""
    if request.param == "memory":
        coordinator = MemoryCoordinator()
    else:
        coordinator = request.getfixturevalue("etcd_client")
    key_prefix = Keyspace(prefix).rendezvous("job").prefix + b"store/"
    # pybind's trampoline finds the Python methods through the Python object: a store that
    # only C++ (the PrefixStore) still references has lost them ("pure virtual function").
    # The agent's rendezvous handler holds its store; so does this list.
    alive = []

    def make() -> dist.Store:
        store = EtcdV3Store(coordinator, key_prefix, TIMEOUT)
        alive.append(store)
        return dist.PrefixStore("agent", store) if request.param == "etcd+prefix" else store

    return make


def skip_if_no_queues(store: dist.Store) -> None:
    """torch's ``_create_store_or_skip_if_no_queues``: the same probe, the same reason."""
    try:
        store.queue_push("test_queue_support", "1")
    except NotImplementedError:
        pytest.skip("Store does not support queues (torch skips this test for such a store)")


def test_set_get_check(make_store):
    store = make_store()
    for amount in (1, 2, 3):
        store.add("key", amount)
    store.set("key0", "value0")
    store.set("key1", "value1")
    store.set("key2", "value2")
    for amount in range(1, 7):
        store.add("key3", amount)
    assert store.num_keys() == 5
    assert [store.get(k) for k in ("key", "key0", "key1", "key2", "key3")] == [
        b"6", b"value0", b"value1", b"value2", b"21"]
    assert store.check(["key3"]) and not store.check(["Randomkey3"])
    store.set("-key3", "7")
    assert store.get("-key3") == b"7"
    store.delete_key("-key3")
    assert store.num_keys() == 5


def test_compare_set(make_store):
    store = make_store()
    # An absent key with a non-empty expected value: nothing set, the expected value back.
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    store.set("cs_key0", "value0")
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    # An absent key with an empty expected value: created.
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert store.get("cs_key1") == b"new_value1"


def test_simple_wait(make_store):
    store = make_store()
    with pytest.raises(RuntimeError, match="[t -i]imeout"):  # torch's own pattern
        store.wait(["bad_key"], datetime.timedelta(seconds=0.25))
    store.add("good_key", 1)
    store.wait(["good_key"])


def test_append(make_store):
    store = make_store()
    assert store.has_extended_api()  # else torch's own test would check nothing
    store.set("foo", "po")
    store.append("foo", "tato")
    assert store.get("foo") == b"potato"


def test_queues(make_store):
    store = make_store()
    skip_if_no_queues(store)
    store.queue_push("foo", "1")
    store.queue_push("foo", "2")
    assert store.queue_len("foo") == 2
    assert [store.queue_pop("foo"), store.queue_pop("foo")] == [b"1", b"2"]


def test_queues_nonblocking(make_store):
    store = make_store()
    skip_if_no_queues(store)
    with pytest.raises(dist.QueueEmptyError):
        store.queue_pop("foo", block=False)


def test_queues_bidirectional(make_store):
    store = make_store()
    skip_if_no_queues(store)
    other = store.clone()
    store.queue_push("a", "a1")
    assert other.queue_pop("a") == b"a1"


def test_queues_timeout(make_store):
    store = make_store()
    skip_if_no_queues(store)
    store.set_timeout(datetime.timedelta(seconds=0.01))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.queue_pop("non_existant")


def test_multi_set(make_store):
    store = make_store()
    store.multi_set(["foo", "bar"], ["po", "tato"])
    assert (store.get("foo"), store.get("bar")) == (b"po", b"tato")


def test_multi_get(make_store):
    store = make_store()
    store.set("foo", "po")
    store.set("bar", "tato")
    assert store.multi_get(["foo", "bar"]) == [b"po", b"tato"]


def test_clone(make_store):
    a = make_store()
    b = a.clone()
    assert isinstance(b, dist.Store)
    a.set("foo", "bar")
    assert b.get("foo") == b"bar"


def test_clone_serves_another_thread(make_store):
    """What clone is for: a handle another thread blocks on while this one writes."""
    a = make_store()
    b = a.clone()
    got = []
    reader = threading.Thread(target=lambda: got.append(b.get("late")))
    reader.start()
    a.set("late", "value")
    reader.join(20)
    assert got == [b"value"]


def test_python_store_through_the_trampoline(make_store):
    """torch's C++ check of a Python store (clone, set, get, add, compare_set, wait...)."""
    dist._test_python_store(make_store())

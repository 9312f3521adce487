"""Gemini placement: shapes, invariants, failure odds (brute force against the paper's closed
form), records."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import pytest

from elasticd.coordination import records
from elasticd.replication.placement import (
    GROUP,
    MIXED,
    Placement,
    PlacementError,
    compute_placement,
    decode_placement,
    encode_placement,
)

SIZES = [(n, m) for n in range(2, 10) for m in range(1, 4)]


def names(n: int) -> list[str]:
    return [f"node-{i}" for i in range(n)]


def brute_lost(p: Placement, dead: set[str]) -> set[str]:
    """Owners with no surviving copy, from the list of copies."""
    surviving = {(o, o) for o in p.nodes if o not in dead}
    surviving |= {(o, h) for o, hs in p.holders.items() for h in hs if h not in dead}
    return {o for o in p.nodes if not any(c[0] == o for c in surviving)}


def brute_probability(p: Placement, k: int) -> Fraction:
    combos = list(itertools.combinations(p.nodes, k))
    bad = sum(1 for dead in combos if brute_lost(p, set(dead)))
    return Fraction(bad, len(combos))


@pytest.mark.parametrize("n,m", SIZES)
def test_shape_follows_gemini(n, m):
    nodes = names(n)
    p = compute_placement(nodes, m=m)
    me = min(m, n)
    assert p.m == me and p.requested_m == m
    assert p.strategy == (GROUP if n % me == 0 else MIXED)
    g = n // me
    assert [len(grp) for grp in p.groups] == [me] * (g - 1) + [me + n % me]
    assert [x for grp in p.groups for x in grp] == nodes  # consecutive, in membership order
    for grp in p.groups:
        s = len(grp)
        for j, owner in enumerate(grp):
            if s == me:  # group placement: every other member of the group
                assert set(p.holders[owner]) == set(grp)
            else:  # ring: the next m-1 members around the last group
                assert p.holders[owner] == tuple(grp[(j + i) % s] for i in range(me))


@pytest.mark.parametrize("n,m", SIZES)
def test_every_owner_has_m_distinct_holders_and_load_is_even(n, m):
    p = compute_placement(names(n), m=m)
    for owner in p.nodes:
        hs = p.holders[owner]
        assert hs[0] == owner
        assert len(hs) == len(set(hs)) == min(m, n)
        assert set(hs) <= set(p.nodes)
        assert p.peers_of(owner) == hs[1:]
    # Each node holds exactly m shards (its own plus m-1), so replica memory is balanced.
    for node in p.nodes:
        assert sum(node in hs for hs in p.holders.values()) == p.m
        assert len(p.held_by(node)) == p.m - 1


def test_known_small_shapes():
    p = compute_placement(["a", "b", "c", "d", "e"], m=2)
    assert p.groups == (("a", "b"), ("c", "d", "e"))
    assert p.holders == {"a": ("a", "b"), "b": ("b", "a"), "c": ("c", "d"),
                         "d": ("d", "e"), "e": ("e", "c")}
    p = compute_placement(["a", "b", "c", "d"], m=2)
    assert p.strategy == GROUP and p.holders["c"] == ("c", "d") and p.holders["d"] == ("d", "c")
    p = compute_placement(["a", "b", "c", "d", "e", "f", "g"], m=3)
    assert p.groups == (("a", "b", "c"), ("d", "e", "f", "g"))
    assert p.holders["g"] == ("g", "d", "e")


def test_deterministic_and_order_sensitive():
    nodes = names(7)
    ranks = {n: [i * 2, i * 2 + 1] for i, n in enumerate(nodes)}
    assert compute_placement(nodes, ranks, 2) == compute_placement(list(nodes), dict(ranks), 2)
    assert compute_placement(nodes, m=2) != compute_placement(list(reversed(nodes)), m=2)


def test_clamped_when_m_exceeds_nodes(caplog):
    p = compute_placement(["a", "b"], m=3)
    assert p.m == 2 and p.clamped and "clamped" in p.describe()
    assert "clamped" in caplog.text
    assert not compute_placement(["a", "b"], m=2).clamped
    single = compute_placement(["a"], m=2)
    assert single.holders == {"a": ("a",)} and single.clamped


@pytest.mark.parametrize(
    "nodes,ranks,m,needle",
    [
        ([], None, 2, "empty"),
        (["a", "a"], None, 2, "more than once"),
        (["a", "b"], None, 0, ">= 1"),
        (["a", "b"], {"a": [0], "b": [0]}, 2, "rank 0"),
        (["a", "b"], {"c": [0]}, 2, "outside"),
        (["a", ""], None, 2, "non-empty"),
    ],
)
def test_invalid_membership(nodes, ranks, m, needle):
    with pytest.raises(PlacementError, match=needle):
        compute_placement(nodes, ranks, m)


def test_rank_lookups():
    p = compute_placement(["a", "b", "c"], {"a": [0, 1], "b": [2, 3], "c": [4, 5]}, m=2)
    assert p.owner_of(3) == "b"
    assert p.holders_of_rank(5) == ("c", "a")
    with pytest.raises(KeyError):
        p.owner_of(6)
    assert brute_lost(p, {"c", "a"}) == {"c"}  # its ranks 4 and 5: no copy left


def group_odds(n: int, m: int, k: int) -> Fraction:
    """The paper's loss probability of group placement (``m`` divides ``n``): some group of
    ``m`` dies whole; inclusion-exclusion over the ``n / m`` groups."""
    g = n // m
    return Fraction(sum((-1) ** (j + 1) * math.comb(g, j) * math.comb(n - j * m, k - j * m)
                        for j in range(1, min(g, k // m) + 1)), math.comb(n, k))


@pytest.mark.parametrize("n,m", SIZES)
def test_group_placement_loses_a_shard_exactly_as_often_as_the_paper_says(n, m):
    p = compute_placement(names(n), m=m)
    if p.strategy == GROUP:
        for k in range(n + 1):
            assert brute_probability(p, k) == group_odds(n, p.m, k), (n, m, k)


def test_loss_odds_known_values():
    # 4 nodes in 2 groups: 2 of the 6 pairs of failures are a whole group.
    p = compute_placement(names(4), m=2)
    assert [brute_probability(p, k) for k in (1, 2, 3)] == [0, Fraction(2, 6), 1]
    # 5 nodes mixed: pair (a,b) or any ring-adjacent pair of (c,d,e): 4 of 10.
    assert brute_probability(compute_placement(names(5), m=2), 2) == Fraction(4, 10)


def test_record_round_trip():
    p = compute_placement(names(5), {n: [i] for i, n in enumerate(names(5))}, m=3, round=7)
    raw = encode_placement(p)
    assert records.decode(raw, "placement")["holders"]["node-4"] == ["node-4", "node-0", "node-1"]
    assert decode_placement(raw) == p


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.update(holders={**b["holders"], "node-0": ["node-1", "node-0"]}),
        lambda b: b.update(holders={**b["holders"], "node-0": ["node-0", "node-0"]}),
        lambda b: b.update(holders={**b["holders"], "node-0": ["node-0", "ghost"]}),
        lambda b: b.update(m="2"),
        lambda b: b.update(strategy="random"),
        lambda b: b.update(nodes="node-0"),
        lambda b: b.pop("holders"),
        lambda b: b.update(ranks={"node-0": [1], "node-1": [1]}),
    ],
)
def test_record_rejects_inconsistent_placements(mutate):
    body = json.loads(encode_placement(compute_placement(names(4), m=2)))
    mutate(body)
    with pytest.raises(records.CorruptRecord):
        decode_placement(json.dumps(body).encode(), key="/jobs/j/placement")


def test_record_rejects_other_kinds_and_newer_schemas(monkeypatch):
    with pytest.raises(records.CorruptRecord):
        decode_placement(records.encode("spec", {}))
    with monkeypatch.context() as m:  # as written by a newer elasticd
        m.setattr(records, "SCHEMA_VERSION", records.SCHEMA_VERSION + 1)
        newer = encode_placement(compute_placement(names(2)))
    with pytest.raises(records.UnsupportedRecordVersion):
        decode_placement(newer)

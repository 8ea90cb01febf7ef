"""Placement (rendezvous hashing) and the cluster view: pure functions, no daemons."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlfs.cluster import placement
from dlfs.cluster.nodes import Node, load_secret, parse_node, parse_nodes, resolve_cluster
from dlfs.cluster.placement import owners, summary, weights
from dlfs.errors import NotFoundError, UsageError

names_st = st.lists(st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True), min_size=2,
                    max_size=9, unique=True)
ids_st = st.binary(min_size=16, max_size=16)


@settings(max_examples=60, deadline=None)
@given(ids_st, names_st, st.integers(1, 300), st.integers(1, 3))
def test_owners_are_distinct_and_independent_of_list_order(dataset_id, names, chunks, r):
    r = min(r, len(names))
    table = owners(dataset_id, chunks, names, r)
    assert table.shape == (chunks, r)
    assert all(len(set(row)) == r for row in table.tolist())
    shuffled = list(reversed(names))
    again = owners(dataset_id, chunks, shuffled, r)
    as_names = [[names[i] for i in row] for row in table.tolist()]
    assert as_names == [[shuffled[i] for i in row] for row in again.tolist()]


@settings(max_examples=60, deadline=None)
@given(ids_st, names_st, st.integers(1, 300), st.integers(1, 3), st.data())
def test_losing_a_node_moves_only_its_chunks(dataset_id, names, chunks, r, data):
    r = min(r, len(names) - 1)
    lost = data.draw(st.sampled_from(names))
    rest = [n for n in names if n != lost]
    before = [[names[i] for i in row] for row in owners(dataset_id, chunks, names, r).tolist()]
    after = [[rest[i] for i in row] for row in owners(dataset_id, chunks, rest, r).tolist()]
    for old, new in zip(before, after, strict=True):
        if lost not in old:
            assert old == new  # untouched chunk keeps its owners, in order
        else:
            assert [n for n in old if n != lost] == new[: r - 1]  # survivors keep their rank


@settings(max_examples=40, deadline=None)
@given(ids_st, st.integers(1, 40), st.integers(0, 500), st.integers(1, 4), st.integers(1, 64))
def test_blocks_and_partial_sort_give_the_full_sort_table(dataset_id, nodes, chunks, r, cells):
    """owners() works a block of chunks at a time and picks the top R by a partial
    sort; the table must be the one a stable full sort of all weights gives."""
    names = [f"node{i}" for i in range(nodes)]
    full = np.argsort(~weights(dataset_id, chunks, names), axis=1, kind="stable")
    want = full[:, :min(r, nodes)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(placement, "BLOCK_CELLS", cells)  # many blocks, ragged last one
        assert np.array_equal(owners(dataset_id, chunks, names, r), want)
    assert np.array_equal(owners(dataset_id, chunks, names, r), want)


def test_a_thousand_nodes_place_without_the_whole_weight_matrix():
    """1,000 nodes x 20,000 chunks: the full matrix and its argsort took ~460 MB; the
    blocks hold a few MB at a time (the table itself is 160 KB)."""
    import tracemalloc

    names = [f"node{i:04d}" for i in range(1000)]
    tracemalloc.start()
    try:
        table = owners(b"k" * 16, 20000, names, 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 << 20, f"placement of 20,000 chunks on 1,000 nodes peaked at {peak} bytes"
    counts = np.bincount(table.ravel(), minlength=1000)
    assert counts.sum() == 40000 and (table[:, 0] != table[:, 1]).all()


def test_shares_are_balanced_for_many_chunks():
    table = owners(b"d" * 16, 30000, [f"node{i}" for i in range(10)], 2)
    counts = np.bincount(table.ravel(), minlength=10)
    assert counts.sum() == 60000
    assert counts.min() > 0.9 * 6000 and counts.max() < 1.1 * 6000


def test_summary_counts_what_the_table_says():
    lengths = np.arange(1, 101, dtype=np.uint64)
    table = owners(b"x" * 16, 100, ["a", "b", "c"], 2)
    rows = summary(table, lengths, 3)
    for node, (primary, held, nbytes) in enumerate(rows):
        mine = np.flatnonzero((table == node).any(axis=1))
        assert held == len(mine) and nbytes == int(lengths[mine].sum())
        assert primary == int((table[:, 0] == node).sum())
    assert sum(r[0] for r in rows) == 100 and sum(r[1] for r in rows) == 200


@pytest.mark.parametrize("text, node", [
    ("n1=10.0.0.1:7100", Node("n1", "10.0.0.1", 7100)),
    ("gpu-07.x=host.example:1", Node("gpu-07.x", "host.example", 1)),
    ("v6=[::1]:7000", Node("v6", "::1", 7000)),
])
def test_parse_node(text, node):
    assert parse_node(text) == node
    assert parse_node(str(node)) == node


@pytest.mark.parametrize("text", ["n1", "n1=host", "=h:1", "n1=h:0", "n1=h:x", "n 1=h:1",
                                  "n1=:7"])
def test_parse_node_rejects(text):
    with pytest.raises(UsageError):
        parse_node(text)


def test_parse_nodes_splits_commas_and_refuses_duplicates():
    assert [n.name for n in parse_nodes(["a=h:1,b=h:2", "c=h:3"])] == ["a", "b", "c"]
    with pytest.raises(UsageError, match="twice"):
        parse_nodes(["a=h:1,a=h:2"])


def test_secret_file_rules(tmp_path):
    good = tmp_path / "s"
    good.write_text("x" * 32 + "\n")
    good.chmod(0o600)
    assert load_secret(str(good)) == b"x" * 32
    good.chmod(0o640)
    with pytest.raises(UsageError, match="chmod 600"):
        load_secret(str(good))
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(UsageError, match="at least"):
        load_secret(str(short))
    with pytest.raises(NotFoundError):
        load_secret(str(tmp_path / "missing"))
    link = tmp_path / "link"
    os.symlink(good, link)
    with pytest.raises(Exception, match="secret"):
        load_secret(str(link))


def test_resolve_cluster_defaults_to_a_pool_of_one():
    view = resolve_cluster((), "solo", 1, None)
    assert view.names == ["solo"] and view.me.name == "solo" and view.secret == b""

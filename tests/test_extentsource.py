"""ExtentSource: the one plan of where an extent's bytes come from, and its descriptors.

The reader and the look-ahead both follow `plan`; these tests pin the plan down
for each kind of chunk (staged or not, owned here, by a peer, by both), with a
real ChunkPool and no peer server (the plan never asks the network), and the
store descriptors' two error policies (a worker's reader, the look-ahead's
threads).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil

import numpy as np
import pytest

import dlfsd.core.extentsource as extentsource
from dlfs.cluster.nodes import ClusterView, Node
from dlfs.cluster.placement import owners
from dlfs.errors import CorruptDataError
from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Dataset, Store
from dlfsd.core.extentsource import DEMAND, TRY_LOCAL, TRY_PEER, ExtentSource
from dlfsd.pool.pool import ChunkPool


@pytest.fixture
def dataset(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(3)
    for i in range(12):
        (src / f"f{i:02d}").write_bytes(rng.bytes(100_000))
    return populate(src, Store(tmp_path / "store"), "ds",
                    PopulateOptions(chunk_size=256 << 10, fsync=False, progress=False))


def two_nodes(replicas: int, dataset: Dataset) -> ClusterView:
    """Nodes a and b, b's name chosen so that with one replica each owns a chunk of
    `dataset`: placement hashes the dataset's uuid (random at populate), and 6 chunks
    all fall on one node once in 32 populates."""
    for suffix in range(64):
        names = ["a", f"b{suffix}"]
        first = owners(dataset.uuid, dataset.chunk_count, names, 1)[:, 0]
        if 0 < int(first.sum()) < dataset.chunk_count:
            break
    else:
        pytest.fail("no node name splits the dataset's chunks between two nodes")
    nodes = (Node(names[0], "127.0.0.1", 1), Node(names[1], "127.0.0.1", 2))
    return ClusterView(nodes, 0, replicas, secrets.token_bytes(32))


def stage(pool: ChunkPool, chunk: int) -> None:
    cache = pool.caches[0]
    cache.dir.mkdir(parents=True, exist_ok=True)
    temp = cache.temp_path(chunk)
    shutil.copyfile(cache.dataset.chunk_path(chunk), temp)
    cache.publish(chunk, temp)


def test_without_a_pool_the_store_is_the_only_source(dataset):
    source = ExtentSource(dataset)
    assert {source.plan(c) for c in range(dataset.chunk_count)} == {0}
    assert source.plan(0, ahead=True) == 0


def test_one_replica_local_if_staged_else_the_owner(dataset, tmp_path):
    """R=1: a chunk this node owns is demanded (read from the store meanwhile), one the
    peer owns is asked of the peer; a staged copy comes first. The look-ahead's plan
    is the same here: no chunk has an owner besides this node and a peer."""
    pool = ChunkPool(two_nodes(1, dataset), [dataset], tmp_path / "cache")
    try:
        owned = pool.owned[0]
        assert owned.any() and not owned.all(), "the test wants chunks on both nodes"
        mine, theirs = int(np.flatnonzero(owned)[0]), int(np.flatnonzero(~owned)[0])
        source = ExtentSource(dataset, pool, 0)
        for ahead in (False, True):
            assert source.plan(mine, ahead) == DEMAND
            assert source.plan(theirs, ahead) == TRY_PEER
        stage(pool, mine)
        stage(pool, theirs)  # a copy of a chunk it does not own (a warm-up, a re-mount)
        for ahead in (False, True):
            assert source.plan(mine, ahead) == TRY_LOCAL | DEMAND
            assert source.plan(theirs, ahead) == TRY_LOCAL | TRY_PEER
    finally:
        pool.close()


def test_two_replicas_a_reader_asks_the_co_owner_the_look_ahead_does_not(dataset, tmp_path):
    """R=2 on two nodes: both own every chunk. A reader without a staged copy asks the
    co-owner, then the store (demanding the chunk); the look-ahead demands it and reads
    ahead from the store (docs/ORDER.md)."""
    pool = ChunkPool(two_nodes(2, dataset), [dataset], tmp_path / "cache")
    try:
        source = ExtentSource(dataset, pool, 0)
        assert source.plan(0) == TRY_PEER | DEMAND
        assert source.plan(0, ahead=True) == DEMAND
        stage(pool, 0)
        assert source.plan(0) == TRY_LOCAL | TRY_PEER | DEMAND
        assert source.plan(0, ahead=True) == TRY_LOCAL | DEMAND
    finally:
        pool.close()


def test_a_store_descriptor_is_opened_once_and_again_after_closing(dataset):
    source = ExtentSource(dataset)
    fd = source.store_fd(0)
    assert source.store_fd(0) == fd == source.store_fd(0, ahead=True)
    assert os.fstat(fd).st_ino == os.stat(dataset.chunk_path(0)).st_ino
    source.close_store_fds()
    with pytest.raises(OSError):
        os.fstat(fd)
    assert os.fstat(source.store_fd(0)).st_ino == os.stat(dataset.chunk_path(0)).st_ino
    source.close_store_fds()


def test_an_unusable_chunk_file_is_eio_for_a_reader_and_left_quiet_for_the_look_ahead(
        dataset, caplog):
    dataset.chunk_path(1).unlink()
    source = ExtentSource(dataset)
    with caplog.at_level(logging.ERROR, "dlfsd.core.extentsource"):
        with pytest.raises(FileNotFoundError):
            source.store_fd(1, ahead=True)
        assert not caplog.records, "the reader reports it when it meets it"
        for _ in range(2):
            with pytest.raises(CorruptDataError):
                source.store_fd(1)
    assert [r.getMessage().startswith("cannot use chunk 1") for r in caplog.records] == [True]


def test_out_of_descriptors_a_reader_closes_its_own_the_look_ahead_does_not(
        dataset, monkeypatch, caplog):
    """A worker serves one request at a time, so none of its kept descriptors is in use:
    it closes them and opens again. The look-ahead's threads may be reading through
    them: it fails that fetch instead."""
    real = extentsource.open_chunk
    refusals = [0]

    def out_of_fds_once(path, index, uuid):
        if refusals[0]:
            refusals[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, index, uuid)

    monkeypatch.setattr(extentsource, "open_chunk", out_of_fds_once)
    source = ExtentSource(dataset)
    kept = source.store_fd(0)
    refusals[0] = 1
    with pytest.raises(OSError) as err:
        source.store_fd(1, ahead=True)
    assert err.value.errno == errno.EMFILE
    os.fstat(kept)  # still open
    refusals[0] = 1
    with caplog.at_level(logging.WARNING, "dlfsd.core.extentsource"):
        fd = source.store_fd(1)
    assert "out of file descriptors" in caplog.text
    for chunk, got in ((1, fd), (0, source.store_fd(0))):  # 0 was closed, opened again
        assert os.fstat(got).st_ino == os.stat(dataset.chunk_path(chunk)).st_ino
    source.close_store_fds()

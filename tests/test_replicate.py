"""A secondary owner's stager copying from its primary (dlfsd.pool.replicate), and each
way that can fail: the primary has nothing yet and never gets it, is down, declines,
or sends bad bytes. The chunk then comes from the store, and says so in a counter.

Real objects throughout: a populated store; the primary is a real ChunkPool (its
copies adopted from files put in its cache dir) behind a real PeerLoopServer on
loopback; the secondary is a real Stager with its copy threads under trio.
Expected bytes are always the store's chunk files.
"""

from __future__ import annotations

import shutil
import socket

import numpy as np
import pytest
import trio
from conftest import chunked_dataset, until

from dlfs.cluster.nodes import ClusterView, Node
from dlfs.cluster.placement import owners
from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfsd.pool import replicate
from dlfsd.pool.chunkcache import ChunkCache
from dlfsd.pool.peerserver import PeerLoopServer
from dlfsd.pool.pool import ChunkPool
from dlfsd.pool.replicate import ReplicaSource
from dlfsd.pool.stager import DemandChannel, Stager

SECRET = b"replicate-test-secret-0123456789"
NAMES = ("p", "s")  # two nodes, --replicas 2: both own every chunk


@pytest.fixture
def dataset(tmp_path):
    return chunked_dataset(tmp_path, files=16, seed=3)


def view(self_index: int, port: int) -> ClusterView:
    nodes = tuple(Node(name, "127.0.0.1", port if name == "p" else 1) for name in NAMES)
    return ClusterView(nodes, self_index, 2, SECRET)


class Primary:
    """Node p: a ChunkPool holding `chunks` (adopted copies), served on loopback."""

    def __init__(self, dataset, root, chunks) -> None:
        cache_dir = root / "cache-p" / dataset.uuid.hex()
        cache_dir.mkdir(parents=True)
        for chunk in chunks:
            shutil.copyfile(dataset.chunk_path(chunk), cache_dir / dataset.chunk_path(chunk).name)
        self.pool = ChunkPool(view(0, 0), [dataset], root / "cache-p")
        self.pool.scan_caches()
        self.server = PeerLoopServer(SECRET, self.pool, "p")
        self.port = self.server.start("127.0.0.1", 0)

    def close(self) -> None:
        self.server.stop()
        self.pool.close()


@pytest.fixture
def primary(dataset, tmp_path):
    made = []

    def make(chunks) -> Primary:
        made.append(Primary(dataset, tmp_path, chunks))
        return made[-1]

    yield make
    for p in made:
        p.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_secondary(dataset, root, port: int, wait: float,
                    mounted_ago: float = 0.0) -> tuple[ReplicaSource, ChunkCache]:
    """Run node s's stager until it holds every chunk (it owns all); its source.
    `mounted_ago`: seconds since the mount started (a peer that refuses connections in
    the first `wait` seconds is taken for one not up yet)."""
    v = view(1, port)
    table = owners(dataset.uuid, dataset.chunk_count, v.names, 2)
    source = ReplicaSource(v, [dataset], [table], peer_timeout=2.0, wait=wait)
    source.started -= mounted_ago
    cache = ChunkCache(root / "cache-s", dataset)
    cache.scan()
    owned = np.ones(dataset.chunk_count, dtype=bool)
    demand = DemandChannel()
    stager = Stager([dataset], [cache], [owned], demand, jobs=2, replicas=source)

    async def main() -> bool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stager.run)
            done = await until(lambda: bool(cache.staged_mask().all()), 30)
            nursery.cancel_scope.cancel()
        return done

    try:
        assert trio.run(main), f"node s did not stage every chunk: {source.snapshot()}"
    finally:
        source.close()
        demand.close()
    return source, cache


def from_primary(source: ReplicaSource) -> int:
    return int((source.primaries[0] >= 0).sum())


def assert_copies_are_the_stores(dataset, cache: ChunkCache) -> None:
    for chunk in range(dataset.chunk_count):
        assert cache.path(chunk).read_bytes() == dataset.chunk_path(chunk).read_bytes(), chunk
    cache.close()


def test_a_secondary_copies_the_primarys_chunks_from_it(dataset, tmp_path, primary):
    p = primary(range(dataset.chunk_count))
    source, cache = stage_secondary(dataset, tmp_path, p.port, wait=30)
    n = from_primary(source)
    assert 0 < n < dataset.chunk_count, "placement gave p no chunk (or all): pick a seed"
    c = source.snapshot()
    assert c["from_peer_chunks"] == n and c["from_store_chunks"] == dataset.chunk_count - n, c
    assert c["from_peer_bytes"] == int(dataset.chunk_lengths[source.primaries[0] >= 0].sum())
    assert c["fallback_down"] + c["fallback_slow"] + c["fallback_declined"] \
        + c["fallback_bad"] == 0, c
    assert p.server.counters()["bytes_served"] == c["from_peer_bytes"]
    assert_copies_are_the_stores(dataset, cache)


def test_a_primary_that_never_stages_them_is_waited_for_a_bounded_time(
        dataset, tmp_path, primary):
    p = primary([])  # owns them, has none: MISS, again and again
    p.pool.set_stager(lambda ds, chunk: True)  # "will stage": the secondary keeps waiting
    source, cache = stage_secondary(dataset, tmp_path, p.port, wait=0.5)
    c = source.snapshot()
    assert c["fallback_slow"] == from_primary(source) > 0, c
    assert c["waits"] >= from_primary(source), c
    assert c["from_peer_chunks"] == 0 and c["from_store_chunks"] == dataset.chunk_count, c
    assert_copies_are_the_stores(dataset, cache)


def test_a_primary_that_declines_sends_them_to_the_store_at_once(dataset, tmp_path, primary):
    p = primary([])
    p.pool.set_stager(lambda ds, chunk: False)  # over its --cache-limit, its disk full
    source, cache = stage_secondary(dataset, tmp_path, p.port, wait=600)
    c = source.snapshot()
    assert c["fallback_declined"] == from_primary(source) > 0, c
    assert c["fallback_slow"] == 0, c
    assert_copies_are_the_stores(dataset, cache)


def test_a_primary_that_is_down_sends_them_to_the_store(dataset, tmp_path):
    # After the start-up window (`wait`) a refused connection means down, not "not up yet".
    source, cache = stage_secondary(dataset, tmp_path, closed_port(), wait=30, mounted_ago=60)
    c = source.snapshot()
    assert c["fallback_down"] == from_primary(source) > 0, c
    assert c["from_store_chunks"] == dataset.chunk_count, c
    assert_copies_are_the_stores(dataset, cache)


def test_bad_bytes_from_the_primary_are_never_published(dataset, tmp_path, primary):
    p = primary(range(dataset.chunk_count))
    table = owners(dataset.uuid, dataset.chunk_count, list(NAMES), 2)
    bad = int(np.flatnonzero(table[:, 0] == 0)[0])  # a chunk s copies from p
    with open(p.pool.caches[0].path(bad), "r+b") as f:  # bit rot in p's copy
        f.seek(CHUNK_HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(CHUNK_HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    source, cache = stage_secondary(dataset, tmp_path, p.port, wait=30)
    c = source.snapshot()
    assert c["fallback_bad"] == 1 and c["from_peer_chunks"] == from_primary(source) - 1, c
    assert_copies_are_the_stores(dataset, cache)


def test_the_waiting_window_bounds_what_waits_for_primaries(dataset, tmp_path, primary,
                                                            monkeypatch):
    monkeypatch.setattr(replicate, "WAITING_WINDOW", 2)
    seen = []
    not_ready = ReplicaSource._not_ready

    def counting(self, node, ds, chunk):
        not_ready(self, node, ds, chunk)
        seen.append(len(self._waiting))

    monkeypatch.setattr(ReplicaSource, "_not_ready", counting)
    p = primary([])
    p.pool.set_stager(lambda ds, chunk: True)
    source, cache = stage_secondary(dataset, tmp_path, p.port, wait=0.3)
    c = source.snapshot()
    assert from_primary(source) > 2, "too few chunks to fill the window"
    assert max(seen) == 2, seen  # the others waited their turn, not at the primary
    assert c["fallback_slow"] == from_primary(source), c
    assert_copies_are_the_stores(dataset, cache)


def test_a_primary_that_hangs_costs_a_peer_timeout_not_a_hang(dataset, tmp_path, primary):
    """The primary takes the connection and the request, then never answers (stuck on
    its disk): each copy thread gives up after --peer-timeout, and the primary's chunks
    come from the store."""
    import threading

    p = primary(range(dataset.chunk_count))
    stuck = threading.Event()
    served = p.pool.staged_file

    def hanging(dataset_id, chunk):
        stuck.wait(30)
        return served(dataset_id, chunk)

    p.pool.staged_file = hanging
    try:
        source, cache = stage_secondary(dataset, tmp_path, p.port, wait=30, mounted_ago=60)
    finally:
        stuck.set()  # let the server's loop go, so it can stop
    c = source.snapshot()
    assert c["fallback_down"] == from_primary(source) > 0, c
    assert c["from_peer_chunks"] == 0, c
    assert_copies_are_the_stores(dataset, cache)

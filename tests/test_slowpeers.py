"""Which peers are slow (dlfsd.pool.slowpeers), as a real ChunkPool applies the rules.

Read times go in through ChunkPool._timed, the call ChunkPool.fetch makes after
every read from a peer: a stall cannot be had on demand from a real peer over
loopback (tests/test_netsim.py gets them from a link that loses packets). What
comes out is what the node sees: the mark in PeerMarks, rendered as `dlfs status`
renders it (HealthWatch, then the problem lines), the node-wide "asked last
until", and the order in which a chunk's owners are asked.

The numbers are those measured over a link losing 1% of single packets (docs/
SCALE.md): 110 KiB reads of 0.6 ms, a few in a hundred waiting ~210 ms.
"""

from __future__ import annotations

import logging
import secrets

import numpy as np
import pytest

from dlfs.cluster.nodes import ClusterView, Node
from dlfs.cluster.placement import owners
from dlfs.obs.healthview import problem_lines
from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Dataset, Store
from dlfsd.base.slots import ProcessSlot
from dlfsd.obs.health import HealthWatch
from dlfsd.obs.peermarks import PeerMarks
from dlfsd.obs.stalls import NO_REQUESTS
from dlfsd.pool.pool import ChunkPool
from dlfsd.pool.slowpeers import TIME_OTHERS

N2, N3 = 1, 2  # node indices; this node is n1 (0)
SIZE, FAST, STALL = 110 << 10, 0.0006, 0.21  # bytes a read, seconds: a read, a stall


@pytest.fixture
def dataset(tmp_path) -> Dataset:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(4)
    for i in range(24):
        (src / f"f{i:02d}").write_bytes(rng.bytes(100_000))
    return populate(src, Store(tmp_path / "store"), "ds",
                    PopulateOptions(chunk_size=256 << 10, fsync=False, progress=False))


@pytest.fixture
def pool(dataset, tmp_path):
    """Three nodes, each owning every chunk; this one reports its marks where `dlfs
    status` reads them. n3's name is chosen so that some chunks list n3 before n2 (so
    "asked last" changes something)."""
    for suffix in range(64):
        names = ["n1", "n2", f"n3{'x' * suffix}"]
        table = owners(dataset.uuid, dataset.chunk_count, names, 3)
        if (table[:, [N2, N3]].argmin(axis=1) == 1).any():  # a chunk lists n3 first
            break
    else:
        pytest.fail("no name of n3 comes before n2 in any chunk's owners")
    nodes = tuple(Node(name, "127.0.0.1", port) for port, name in enumerate(names, 1))
    pool = ChunkPool(ClusterView(nodes, 0, 3, secrets.token_bytes(32)), [dataset],
                     tmp_path / "cache")
    pool.report_to(NO_REQUESTS, PeerMarks(ProcessSlot(1), len(nodes)))
    yield pool
    pool.close()


def status_lines(pool: ChunkPool) -> list[str]:
    """The problem lines `dlfs status` prints for this node now."""
    assert isinstance(pool.marks, PeerMarks)
    health = HealthWatch(NO_REQUESTS, 10.0, str, peer_marks=pool.marks, pool=pool).check()
    return problem_lines(health)


def is_slow(pool: ChunkPool, node: int) -> bool:
    return bool(pool._node_slow[node] > 0)


def asked_first(pool: ChunkPool, node: int) -> int:
    """How many chunks ask `node` first now."""
    return sum(next(pool._live_owners(0, chunk)) == node
               for chunk in range(pool.datasets[0].chunk_count))


def read(pool: ChunkPool, node: int, took: float, times: int = 1) -> None:
    for _ in range(times):
        pool._timed(node, took, SIZE)


def stalling(pool: ChunkPool, every: int, reads: int, node: int = N3) -> int | None:
    """`reads` reads of `node`, each `every`th one a stall, between fast reads of n2;
    the read after which `node` was slow, None if it never was."""
    for i in range(1, reads + 1):
        read(pool, N2, FAST)
        read(pool, node, STALL if i % every == 0 else FAST)
        if is_slow(pool, node):
            return i
    return None


@pytest.mark.parametrize("hiccups", [(100,), (100, 110)])
def test_a_healthy_peer_with_a_hiccup_or_two_is_not_slow(pool, hiccups):
    """A read of n3 waits 300 ms (a GC pause, a descheduled worker), or two do, 10 reads
    apart, among 200 fast reads of n3 and of n2: n3 is not slow (three stalls needed)."""
    for i in range(200):
        read(pool, N2, FAST)
        read(pool, N3, 0.3 if i in hiccups else FAST)
    assert not is_slow(pool, N3) and not is_slow(pool, N2)
    assert status_lines(pool) == []


def test_a_peer_stalling_on_3_percent_of_its_reads_is_asked_last(pool, caplog):
    """Each 33rd read of n3 waits 210 ms, the others take 0.6 ms, as do n2's: n3 is slow
    once its last reads hold three stalls (the 99th read), asked last for every chunk,
    logged once, and `dlfs status` says which peer and what was measured."""
    assert asked_first(pool, N3) > 0
    with caplog.at_level(logging.WARNING, logger="dlfsd.pool.pool"):
        assert stalling(pool, every=33, reads=400) == 99
    assert not is_slow(pool, N2)
    assert asked_first(pool, N3) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "slow (mean" in warnings[0], warnings
    [line] = status_lines(pool)
    n3 = pool.view.nodes[N3].name
    assert f"peer {n3} is slow" in line and "asked last" in line, line
    # 99 reads: 96 of 0.6 ms, 3 of 210 ms; n2 0.6 ms for the same bytes
    assert "mean 6.9 ms a read over its last 99 reads, 3 over 100 ms; n2 0.6 ms" in line, line


def test_a_lone_peer_is_not_slow_however_it_stalls(pool):
    """n3 stalls on each 10th read, but no other peer was read: nothing is known to be
    faster, so it stays first where placement puts it. Once n2 has TIME_OTHERS fast reads
    measured, n3's next stalls make it slow."""
    for i in range(1, 301):
        read(pool, N3, STALL if i % 10 == 0 else FAST)
    assert not is_slow(pool, N3)
    read(pool, N2, FAST, TIME_OTHERS)
    for i in range(1, 31):
        read(pool, N3, STALL if i % 10 == 0 else FAST)
    assert is_slow(pool, N3)


def test_peers_that_stall_alike_are_not_slow(pool):
    """n2 and n3 both stall on each 20th read (a loaded reader, not a bad link): neither
    is faster than the other, neither is slow."""
    for i in range(1, 401):
        read(pool, N2, STALL if i % 20 == 0 else FAST)
        read(pool, N3, STALL if (i + 10) % 20 == 0 else FAST)
    assert not is_slow(pool, N2) and not is_slow(pool, N3)


def test_a_10_mbit_peer_is_slow_by_the_share_of_slow_reads(pool):
    """The share rule still marks a peer slow on every read (110 KiB in 90 ms: a 10 Mbit/s
    link), after three such reads, with no other peer measured."""
    read(pool, N3, 0.09, 2)
    assert not is_slow(pool, N3)
    read(pool, N3, 0.09)
    assert is_slow(pool, N3)
    [line] = status_lines(pool)
    assert "of its recent reads slow" in line and "asked last" in line, line

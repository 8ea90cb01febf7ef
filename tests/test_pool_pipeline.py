"""ChunkPool.fetch_many and PeerShare.prefetch_many with a real PeerLoopServer, in one
process (the set-up of test_pool_reader.py): the extents that go to one owner go
out pipelined on one connection, each checked as `fetch` checks one; what the owner
cannot serve ends as None (no other owner here), never as wrong bytes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time

from test_pool_reader import dataset, holder_of_every_chunk, reading_node

from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfsd.pool.peershare import extent_key
from dlfsd.pool.peersync import BATCH_READS

__all__ = ["dataset"]  # the fixture used here

HOLDER = 1  # node b: reading_node's pool is node a


def extent_reads(ds) -> list[tuple[int, int, int, int, int]]:
    """Every extent of the dataset as fetch_many takes it."""
    d = ds.directory
    return [(0, int(d.ext_chunk_view[e]), int(d.ext_offset_view[e]),
             int(d.ext_length_view[e]), int(d.ext_checksum_view[e]))
            for e in range(d.extent_count)]


def staged_bytes(holder, read) -> bytes:
    """What the holder's staged copy has for a read (the bytes the peer must send)."""
    _, chunk, offset, length, _ = read
    return os.pread(holder.caches[0].fd(chunk), length, CHUNK_HEADER_SIZE + offset)


def pool_secret(holder) -> bytes:
    """The job secret of the holder's view (reading_node's pool must share it)."""
    return holder.view.secret


@contextlib.contextmanager
def holder_and_reader(ds, tmp_path):
    """The holder of every chunk (node b, its server) and the reading node's pool (node
    a), closed after the block: (holder, server, pool)."""
    with holder_of_every_chunk(ds, secrets.token_bytes(32), tmp_path / "b") as (
            holder, server, port):
        pool, reader = reading_node(ds, pool_secret(holder), port, tmp_path / "a")
        try:
            yield holder, server, pool
        finally:
            reader.close()
            pool.close()


def fetch_all(pool, reads) -> dict[int, bytes | None]:
    got: dict[int, bytes | None] = {}

    def on_fetched(index: int, data) -> None:
        assert index not in got  # once per read
        got[index] = None if data is None else bytes(data)

    pool.fetch_many(reads, on_fetched)
    assert sorted(got) == list(range(len(reads)))
    return got


def test_fetch_many_returns_each_extent_checked_over_one_connection(dataset, tmp_path):
    ds, _ = dataset
    reads = extent_reads(ds)
    with holder_and_reader(ds, tmp_path) as (holder, server, pool):
        got = fetch_all(pool, reads)
        assert got == {i: staged_bytes(holder, r) for i, r in enumerate(reads)}
        counts = server.counters()
        assert counts["reads_served"] == len(reads) > BATCH_READS  # more than one round
        assert counts["connections_accepted"] == 1
        assert pool.fetch_counters()["fetches"] == len(reads)


def test_what_the_owner_misses_or_sends_bad_is_none_and_the_rest_arrives(dataset, tmp_path):
    """A chunk the holder has not staged (MISS) and an extent whose bytes fail their
    checksum (a bad copy there) end as None, in the middle of the batch, and so do the
    extents of that chunk after it (as `fetch` would: that copy is avoided); the other
    extents arrive; the peer stays up, the bad copy is marked for its chunk only."""
    ds, _ = dataset
    reads = extent_reads(ds)
    chunks = sorted({r[1] for r in reads})
    assert len(chunks) >= 3
    missing, bad_chunk = chunks[1], chunks[2]
    bad = next(i for i, r in enumerate(reads) if r[1] == bad_chunk)
    reads[bad] = (*reads[bad][:4], reads[bad][4] ^ 1)  # what the manifest says differs
    with holder_and_reader(ds, tmp_path) as (holder, server, pool):
        holder.caches[0].evict(missing)
        got = fetch_all(pool, reads)
        for i, read in enumerate(reads):
            if read[1] in (missing, bad_chunk):  # the bad one's chunk: read elsewhere
                assert got[i] is None, i
            else:
                assert got[i] == staged_bytes(holder, read), i
        assert server.counters()["reads_missed"] == sum(r[1] == missing for r in reads)
        assert server.counters()["connections_accepted"] == 1
        assert pool._node_down[HOLDER] <= time.monotonic()  # a miss is no failure
        assert (HOLDER, 0, bad_chunk) in pool._bad_copies


def test_a_peer_gone_fails_the_batch_to_none_and_marks_it_down(dataset, tmp_path):
    ds, _ = dataset
    reads = extent_reads(ds)[:5]
    with holder_and_reader(ds, tmp_path) as (_, server, pool):
        pool.peer_timeout = 1.0
        assert all(v is not None for v in fetch_all(pool, reads).values())
        server.stop()
        started = time.monotonic()
        assert fetch_all(pool, reads) == dict.fromkeys(range(len(reads)))
        assert time.monotonic() - started < 5.0
        assert pool._node_down[HOLDER] > time.monotonic()


def test_prefetch_many_fills_the_share_and_lets_every_claim_go(dataset, tmp_path):
    ds, _ = dataset
    d = ds.directory
    reads = extent_reads(ds)[:12]
    keys = [extent_key(0, e) for e in range(len(reads))]
    with holder_and_reader(ds, tmp_path) as (holder, server, pool):
        share = pool.share
        assert share is not None
        lengths = [r[3] for r in reads]
        assert share.prefetch_many(keys, pool.fetch_many, reads) == lengths
        for key, read in zip(keys, reads, strict=True):
            assert share.copy_out(key, 0, read[3], True) == staged_bytes(holder, read)
        served = server.counters()["reads_served"]
        assert share.prefetch_many(keys, pool.fetch_many, reads) == lengths  # held
        assert server.counters()["reads_served"] == served == len(reads)
        assert not share._fetching and bool((share._in_flight == -1).all())
        holder.caches[0].evict(int(d.ext_chunk_view[len(reads)]))
        more = extent_reads(ds)[len(reads):len(reads) + 4]
        got = share.prefetch_many([extent_key(0, len(reads) + i) for i in range(4)],
                                  pool.fetch_many, more)
        assert got[0] is None  # its chunk is gone there: read elsewhere
        assert not share._fetching and bool((share._in_flight == -1).all())


def test_prefetch_many_tells_of_each_extent_in_its_slot_before_letting_it_go(
        dataset, tmp_path):
    """The look-ahead marks an extent for its reader (PEER_AHEAD: a hit) when it lands:
    `landed` is told while the extent's claim still holds waiting readers back, with
    its bytes already in their slot, each extent once, in the order the replies come."""
    ds, _ = dataset
    reads = extent_reads(ds)[:12]
    keys = [extent_key(0, e) for e in range(len(reads))]
    with holder_and_reader(ds, tmp_path) as (holder, _, pool):
        share = pool.share
        assert share is not None
        told: list[int] = []

        def landed(i: int, got: int | None) -> None:
            assert got == reads[i][3]
            assert keys[i] in share._fetching  # still claimed: a waiter still waits
            assert share.copy_out(keys[i], 0, got, True) == staged_bytes(holder, reads[i])
            told.append(i)

        share.prefetch_many(keys, pool.fetch_many, reads, landed)
        assert told == list(range(len(reads)))
        assert not share._fetching

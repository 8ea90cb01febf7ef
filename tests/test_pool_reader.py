"""The tiered reader with a real ChunkPool and a real PeerLoopServer, in one process.

No FUSE here: SampleReader, ChunkPool, Stager copies, the daemon's peer server
(on its own thread, as in the daemon) and the blocking peer client the worker
processes use are the real objects; only the processes are collapsed into one,
so the test can count exactly how many requests reached the peer.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

import numpy as np
import pytest
from conftest import until

from dlfs.cluster.nodes import ClusterView, Node
from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Store
from dlfsd.base.slots import ProcessSlot
from dlfsd.core.reader import SampleReader
from dlfsd.obs.stats import Stats
from dlfsd.pool.peerserver import PeerLoopServer
from dlfsd.pool.pool import ChunkPool
from dlfsd.pool.stager import DemandChannel, Stager


@pytest.fixture
def dataset(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(5)
    for i in range(40):
        (src / f"f{i:02d}").write_bytes(rng.bytes(int(rng.integers(1, 60_000))))
    (src / "big").write_bytes(rng.bytes(700_000))
    return populate(src, Store(tmp_path / "store"), "ds",
                    PopulateOptions(chunk_size=256 << 10, fsync=False, progress=False)), src


def view(me: int, ports: list[int], secret: bytes) -> ClusterView:
    nodes = tuple(Node(name, "127.0.0.1", port) for name, port in zip("ab", ports, strict=True))
    return ClusterView(nodes, me, 1, secret)


def test_remote_files_come_from_the_peer_and_bytes_are_right(dataset, tmp_path):
    ds, src = dataset
    secret = secrets.token_bytes(32)
    d = ds.directory
    # The holder serves, the other node reads. Placement hashes the dataset's random
    # uuid, so now and then node b owns no chunk holding a small file: then a holds.
    for me in (1, 0):
        holder = ChunkPool(view(me, [1, 1], secret), [ds], tmp_path / f"cache-{me}")
        remote_files = [name for name in sorted(p.name for p in src.iterdir())
                        if all(holder.owned[0][d.ext_chunk_view[e]]
                               for e in d.extents(d.resolve(name.encode())))
                        and len(d.extents(d.resolve(name.encode()))) == 1]
        if remote_files:
            break
        holder.close()
    assert remote_files, "neither node owns a chunk that holds a small file"
    holder.caches[0].scan()
    stager = Stager([ds], holder.caches, holder.owned, holder.demand)
    for chunk in np.flatnonzero(holder.owned[0]):
        stager._copy(0, int(chunk), bytearray())  # stage the holder's share synchronously
    server = PeerLoopServer(secret, holder, "ab"[me])
    port = server.start("127.0.0.1", 0)
    try:
        ports = [1, 1]
        ports[me] = port
        reader_pool = ChunkPool(view(1 - me, ports, secret), [ds], tmp_path / "cache-reader")
        reader_pool.caches[0].scan()
        stats = Stats(["ds"], [ds.directory], ProcessSlot(1))
        reader = SampleReader(ds, pool=reader_pool)
        reader.stats = stats
        name = remote_files[0]
        want = (src / name).read_bytes()
        assert bytes(reader.read(d.resolve(name.encode()), 0, len(want))) == want
        assert server.counters()["reads_served"] == 1  # one extent: one request
        for name in remote_files:  # every remote file, whole, from the peer
            row = d.resolve(name.encode())
            assert bytes(reader.read(row, 0, 1 << 20)) == (src / name).read_bytes()
        sources = stats.snapshot()["datasets"]["ds"]["sources"]
        assert sources["store"]["reads"] == 0
        assert sources["peer"]["reads"] == len(remote_files) + 1
    finally:
        server.stop()
    reader.close()
    reader_pool.close()
    holder.close()
    stats.close()


@contextlib.contextmanager
def holder_of_every_chunk(ds, secret: bytes, cache: Path):
    """Node b with every chunk staged (owned or not), its peer server on loopback:
    yields (pool, server, port)."""
    holder = ChunkPool(view(1, [1, 1], secret), [ds], cache)
    holder.caches[0].scan()
    stager = Stager([ds], holder.caches, holder.owned, holder.demand)
    for chunk in range(ds.chunk_count):
        holder.owned[0][chunk] = True
        stager._copy(0, chunk, bytearray())
    server = PeerLoopServer(secret, holder, "b")
    try:
        yield holder, server, server.start("127.0.0.1", 0)
    finally:
        server.stop()
        holder.close()


def small_files_by_chunk(ds, src: Path) -> dict[int, list[str]]:
    """Names of the one-extent files, by the chunk holding them."""
    d = ds.directory
    by_chunk: dict[int, list[str]] = {}
    for name in sorted(p.name for p in src.iterdir()):
        exts = d.extents(d.resolve(name.encode()))
        if len(exts) == 1:
            by_chunk.setdefault(int(d.ext_chunk_view[exts[0]]), []).append(name)
    return by_chunk


def test_partial_reads_of_a_remote_extent_fetch_it_once(dataset, tmp_path):
    ds, src = dataset
    secret = secrets.token_bytes(32)
    with holder_of_every_chunk(ds, secret, tmp_path / "cache-b") as (_, server, port):
        # Both nodes own every chunk and a has staged none: every extent comes from b
        # (with one replica, placement by the random uuid gave b no chunk of "big" now
        # and then, and the test then read nothing from a peer).
        reader_pool, reader = reading_node(ds, secret, port, tmp_path / "cache-a")
        try:
            d = ds.directory
            row = d.resolve(b"big")
            want = (src / "big").read_bytes()
            got = bytearray()
            for off in range(0, len(want), 64 << 10):  # 64 KiB requests, like the kernel's
                got += reader.read(row, off, 64 << 10)
            assert bytes(got) == want
            extents = len(d.extents(row))
            assert extents > 1 and server.counters()["reads_served"] == extents  # one each
        finally:
            reader.close()
            reader_pool.close()


def reading_node(ds, secret: bytes, port: int, cache: Path) -> tuple[ChunkPool, SampleReader]:
    """Node a with two replicas: b owns every chunk too and a has staged nothing, so
    every read goes to b first, then to the store."""
    both = ClusterView(view(0, [1, port], secret).nodes, 0, 2, secret)
    pool = ChunkPool(both, [ds], cache)
    return pool, SampleReader(ds, pool=pool)


def test_a_staged_copy_the_holder_cannot_read_is_evicted_and_asked_for_again(
        dataset, tmp_path):
    """The holder's peer server treats an unreadable staged copy (here: truncated) as a
    reader does: FAIL to that peer, who reads from the store instead; the copy is evicted,
    the chunk goes to the front of the staging queue, and later peers get MISS."""
    ds, src = dataset
    secret = secrets.token_bytes(32)
    chunk, names = max(small_files_by_chunk(ds, src).items(), key=lambda item: len(item[1]))
    assert len(names) >= 2
    d = ds.directory
    with holder_of_every_chunk(ds, secret, tmp_path / "cache-b") as (holder, server, port):
        reader_pool, reader = reading_node(ds, secret, port, tmp_path / "cache-a")
        os.truncate(holder.caches[0].path(chunk), CHUNK_HEADER_SIZE + 10)  # failing copy
        for name in names[:2]:
            row = d.resolve(name.encode())
            assert bytes(reader.read(row, 0, 1 << 20)) == (src / name).read_bytes()
        counts = server.counters()
        assert counts["read_errors"] == 1 and counts["reads_missed"] == 1
        assert counts["bytes_served"] == 0
        assert not holder.caches[0].is_staged(chunk)
        assert not holder.caches[0].path(chunk).exists()
        demanded = os.read(holder.demand.read_fd, 4096)
        assert (0, chunk) in set(DemandChannel.RECORD.iter_unpack(demanded))
    reader.close()
    reader_pool.close()


async def test_a_peer_with_one_bad_copy_still_serves_its_other_chunks(dataset, tmp_path):
    """Bytes from a peer that fail their checksum mean a bad staged copy of that chunk
    there (a flipped bit), not a bad peer: that chunk is read from the store, the peer's
    other chunks still come from the peer, and the peer is told (REPORT) and re-stages
    that copy."""
    ds, src = dataset
    secret = secrets.token_bytes(32)
    in_chunk = small_files_by_chunk(ds, src)
    chunks = sorted(in_chunk, key=lambda c: -len(in_chunk[c]))
    assert len(chunks) >= 2 and len(in_chunk[chunks[0]]) >= 2
    bad, good = chunks[0], chunks[1]
    d = ds.directory
    with holder_of_every_chunk(ds, secret, tmp_path / "cache-b") as (holder, server, port):
        reader_pool, reader = reading_node(ds, secret, port, tmp_path / "cache-a")
        stats = Stats(["ds"], [ds.directory], ProcessSlot(1))
        reader.stats = stats
        ext = d.first_extent(d.resolve(in_chunk[bad][0].encode()))
        with open(holder.caches[0].path(bad), "r+b") as f:  # flip a byte of the first file
            f.seek(CHUNK_HEADER_SIZE + int(d.ext_offset_view[ext]))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))

        def read(name: str) -> None:
            row = d.resolve(name.encode())
            assert bytes(reader.read(row, 0, 1 << 20)) == (src / name).read_bytes()

        def sources() -> tuple[int, int]:
            s = stats.snapshot()["datasets"]["ds"]["sources"]
            return s["peer"]["reads"], s["store"]["reads"]

        read(in_chunk[bad][0])  # the peer's bytes fail the checksum: the store's
        assert server.counters()["reads_served"] == 1 and sources() == (0, 1)
        read(in_chunk[bad][1])  # same chunk: straight to the store
        assert server.counters()["reads_served"] == 1 and sources() == (0, 2)
        read(in_chunk[good][0])  # another chunk of the same peer: from the peer
        assert server.counters()["reads_served"] == 2 and sources() == (1, 2)
        # The reader reported the range; the holder found its copy bad there, evicted it
        # and asked its stager for it again (its own readers had never touched it).
        assert await until(lambda: server.counters()["reports_confirmed"] == 1, 10)
        assert not holder.caches[0].is_staged(bad)
        demanded = os.read(holder.demand.read_fd, 4096)
        assert (0, bad) in set(DemandChannel.RECORD.iter_unpack(demanded))
    reader.close()
    reader_pool.close()
    stats.close()


def pool_with_chunk_0_staged(ds, cache: Path) -> tuple[ChunkPool, Stager]:
    """A one-node pool that owns and has staged chunk 0, and its stager."""
    pool = ChunkPool(view(1, [1, 1], secrets.token_bytes(32)), [ds], cache)
    pool.caches[0].scan()
    stager = Stager([ds], pool.caches, pool.owned, pool.demand)
    pool.owned[0][0] = True
    stager._copy(0, 0, bytearray())
    return pool, stager


def test_a_late_failure_of_a_replaced_copy_does_not_evict_the_new_one(dataset, tmp_path):
    """A read of an old copy can fail after the copy was evicted and staged anew (a failing
    disk retries for seconds); that failure must not evict the good new copy."""
    ds, _ = dataset
    holder, stager = pool_with_chunk_0_staged(ds, tmp_path / "cache")
    old_fd, _ = holder.staged_file(ds.uuid, 0)
    holder.caches[0].evict(0)  # a reader found it bad; the stager copies it again
    stager._copy(0, 0, bytearray())
    assert not holder.staged_copy_failed(ds.uuid, 0, old_fd)  # the old copy's late failure
    assert holder.caches[0].is_staged(0) and holder.caches[0].path(0).exists()
    assert not holder.staged_copy_failed(ds.uuid, 0, -1)  # could not open it (EMFILE...)
    assert holder.caches[0].is_staged(0) and holder.caches[0].path(0).exists()
    new_fd, _ = holder.staged_file(ds.uuid, 0)
    assert new_fd != old_fd, "the old copy's fd number was handed out again"
    assert not holder.staged_copy_failed(ds.uuid, 0, old_fd)  # even after the reopen
    assert holder.staged_copy_failed(ds.uuid, 0, new_fd)  # the current copy failing: evicted
    assert not holder.caches[0].is_staged(0) and not holder.caches[0].path(0).exists()
    holder.close()


def test_a_reader_whose_read_of_a_replaced_copy_fails_keeps_the_new_one(dataset, tmp_path):
    """The same race on the reader's side: worker A's slow read of the old copy fails after
    worker B evicted it and the stager staged it anew."""
    ds, _ = dataset
    pool, stager = pool_with_chunk_0_staged(ds, tmp_path / "cache")
    reader = SampleReader(ds, pool=pool)
    old_fd = pool.caches[0].open_fd(0)  # A's copy, open while its read is under way
    pool.caches[0].evict(0)  # B found it bad; the stager copies it again
    stager._copy(0, 0, bytearray())
    reader._evict(0, old_fd, "late read error")
    assert pool.caches[0].is_staged(0) and pool.caches[0].path(0).exists()
    new_fd = pool.caches[0].open_fd(0)  # A's next read opens the new copy; it fails too
    reader._evict(0, new_fd, "read error")
    assert not pool.caches[0].is_staged(0) and not pool.caches[0].path(0).exists()
    reader.close()
    pool.close()


def test_a_staged_copy_that_cannot_be_opened_is_read_from_the_store(dataset, tmp_path):
    """An open that fails (here ELOOP; on a node: EMFILE, EACCES, EIO from the NVMe)
    must send the read on to the store, not fail it with that errno."""
    ds, src = dataset
    pool, _ = pool_with_chunk_0_staged(ds, tmp_path / "cache")
    reader = SampleReader(ds, pool=pool)
    path = pool.caches[0].path(0)
    path.unlink()
    path.symlink_to(path.name)  # a link to itself: opening it fails with ELOOP
    d = ds.directory
    name = next(p.name for p in sorted(src.iterdir())
                if d.ext_chunk_view[d.first_extent(d.resolve(p.name.encode()))] == 0)
    row = d.resolve(name.encode())
    for _ in range(2):  # and again (logged once)
        assert bytes(reader.read(row, 0, 4096)) == (src / name).read_bytes()[:4096]
    reader.close()
    pool.close()


def test_partial_reads_of_a_peer_extent_keep_it_once_for_its_other_parts(dataset, tmp_path):
    """The first partial read of a peer extent fetches it whole and keeps it in one slot
    of the node's PeerShare; the reads of its other parts, in any order and whichever
    process makes them, are served from there, not fetched again."""
    ds, src = dataset
    secret = secrets.token_bytes(32)
    with holder_of_every_chunk(ds, secret, tmp_path / "cache-b") as (_, server, port):
        reader_pool, reader = reading_node(ds, secret, port, tmp_path / "cache-a")
        try:
            row = ds.directory.resolve(b"big")
            want = (src / "big").read_bytes()
            offsets = list(range(0, len(want), 16 << 10))
            np.random.default_rng(3).shuffle(offsets)
            got = {off: bytes(reader.read(row, off, 16 << 10)) for off in offsets}
            assert b"".join(got[off] for off in sorted(got)) == want
            extents = len(ds.directory.extents(row))
            assert server.counters()["reads_served"] == extents
            counts = reader_pool.fetch_counters()
            assert counts["fetches"] == counts["stored"] == extents
            assert counts["shared_reads"] == len(offsets) - extents
            assert bytes(reader.read(row, 4096, 100)) == want[4096:4196]
            assert server.counters()["reads_served"] == extents  # from the slot
            assert reader_pool.fetch_counters()["shared_reads"] == len(offsets) - extents + 1
        finally:
            reader.close()
            reader_pool.close()


def test_verify_served_checks_each_extent_once_per_staged_copy(dataset, tmp_path):
    """--verify-served's bookkeeping in the pool: an extent of chunk 0 is to be checked
    until it checked out in this copy; a copy staged anew is checked again; a range that
    is not one whole extent is not checked (readers only ask for whole extents)."""
    ds, _ = dataset
    pool, stager = pool_with_chunk_0_staged(ds, tmp_path / "cache")
    d = ds.directory
    ext = int(pool.extents_in(0, 0, 0, 1)[0])
    offset, length = int(d.ext_offset_view[ext]), int(d.ext_length_view[ext])
    check = pool.serve_check(ds.uuid, 0, offset, length)
    assert check is not None and check[:2] == (ext, int(d.ext_checksum_view[ext]))
    assert pool.serve_check(ds.uuid, 0, offset, length - 1) is None
    pool.served_checked(ds.uuid, ext, check[2])
    assert pool.serve_check(ds.uuid, 0, offset, length) is None
    pool.caches[0].evict(0)
    assert pool.serve_check(ds.uuid, 0, offset, length) is None  # not staged: nothing served
    stager._copy(0, 0, bytearray())
    again = pool.serve_check(ds.uuid, 0, offset, length)
    assert again is not None and again[2] != check[2]
    pool.close()


def _answer_the_peer_server(pool: ChunkPool, dataset_id: bytes, extent: tuple[int, int],
                            pipe) -> None:
    """In a forked process, like a peer server (dlfsd.pool.peerprocs): answer what the
    server would ask, each time the parent asks."""
    while pipe.recv():
        pipe.send((pool.will_stage(dataset_id, 1), pool.will_stage(dataset_id, 2),
                   pool.serve_check(dataset_id, 0, *extent) is not None))


def test_a_peer_server_forked_before_sees_the_stagers_and_the_checks_later_word(
        dataset, tmp_path):
    """The peer server's processes are forked at mount; whether the stager (main
    process) will stage a chunk, and which extents another server process already
    checked (--verify-served), change later and must reach them: shared memory."""
    import errno
    import multiprocessing

    ds, _ = dataset
    pool, stager = pool_with_chunk_0_staged(ds, tmp_path / "cache")
    pool.set_stager(stager.will_stage)
    pool.owned[0][1] = pool.owned[0][2] = True  # (the stager's owned masks too)
    d = ds.directory
    ext = int(pool.extents_in(0, 0, 0, 1)[0])
    extent = (int(d.ext_offset_view[ext]), int(d.ext_length_view[ext]))
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(
        target=_answer_the_peer_server, args=(pool, ds.uuid, extent, theirs))
    child.start()
    try:
        ours.send(True)
        assert ours.recv() == (True, True, True)
        stager.cache_limit = 1  # chunk 1 no longer fits: passed over for --cache-limit
        assert not stager._eligible(0, 1)
        pool.served_checked(ds.uuid, ext, pool.serve_check(ds.uuid, 0, *extent)[2])
        ours.send(True)
        assert ours.recv() == (False, True, False)
        stager._pause(0, OSError(errno.ENOSPC, "No space left on device"), 0.0)  # disk full
        ours.send(True)
        assert ours.recv() == (False, False, False)
    finally:
        ours.send(False)
        child.join(10)
        pool.close()

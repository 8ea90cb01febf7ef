"""The stager's scheduling and shutdown, and the workers' blocking peer client's
connection reuse and shared receive buffer.

Real objects throughout: a populated store, ChunkCaches in tmp_path, the Stager
under a real trio run with its real copy threads (slowed by its own store
pacing and a smaller copy step, so a copy is still in flight when the test
looks, even on a busy machine), and BlockingPeerClients against the daemon's
PeerLoopServer or a small trio server on loopback.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import numpy as np
import pytest
import trio
import trio.testing
from conftest import chunked_dataset, until
from peerfakes import DATASET, SECRET, FileProvider, version_1_server

from dlfs.store.nodecache import ABOUT, IN_USE, LAST_USED
from dlfsd.pool import protocol
from dlfsd.pool import stager as stager_module
from dlfsd.pool.chunkcache import ChunkCache
from dlfsd.pool.peer import PeerUnavailable
from dlfsd.pool.peerserver import PeerLoopServer
from dlfsd.pool.peersync import BlockingPeerClient
from dlfsd.pool.stager import DemandChannel, Stager

STEP = 16 << 10  # the stager's copy step in these tests
RATE = 32 << 10  # store pacing: a step takes 0.5 s, a 256 KiB chunk about 8 s


# -- the stager ------------------------------------------------------------------------

@pytest.fixture
def dataset(tmp_path):
    """A dataset of at least three 256 KiB chunks."""
    ds = chunked_dataset(tmp_path, files=4, seed=7)
    assert ds.chunk_count >= 3
    return ds


def copies_and_temp_files(directory) -> list[str]:
    """What a cache dir holds besides the node cache's bookkeeping (.last-used, .in-use)."""
    return sorted(n for n in os.listdir(directory) if n not in (LAST_USED, IN_USE, ABOUT))



@pytest.fixture
def slow_stager(dataset, tmp_path, monkeypatch):
    """make(owned, jobs) -> a Stager of `dataset` whose copies take about 8 s (0.5 s a step)."""
    monkeypatch.setattr(stager_module, "READ_BLOCK", STEP)
    made = []

    def make(owned: np.ndarray, jobs: int) -> Stager:
        cache = ChunkCache(tmp_path / "cache", dataset)
        cache.scan()
        stager = Stager([dataset], [cache], [owned], DemandChannel(), jobs=jobs,
                        store_rate=RATE)
        made.append(stager)
        return stager

    yield make
    for stager in made:
        stager.caches[0].close()
        stager.demand.close()


async def test_idle_jobs_that_woke_for_nothing_still_wake_for_later_demands(
        dataset, slow_stager):
    """Two idle jobs woken by a demand neither can take (a chunk this node does not
    own) must both wake for the next demands: staging keeps its concurrency."""
    owned = np.zeros(dataset.chunk_count, dtype=bool)
    stager = slow_stager(owned, jobs=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stager.run)
        await trio.testing.wait_all_tasks_blocked(cushion=0.01)  # both jobs idle
        stager.demand.send(0, 2)  # not owned: both wake, neither has anything to do
        await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        owned[:2] = True
        stager.demand.send(0, 0)
        stager.demand.send(0, 1)
        # Well within the first copy (8 s): a job left asleep would only take the second
        # chunk once the first copy is over, never both at once.
        both = await until(lambda: len(stager._busy) == 2, 5)
        nursery.cancel_scope.cancel()
    assert both, "only one job woke for two demanded chunks"


async def test_unmount_abandons_copies_in_flight_at_once_and_leaves_no_temp_file(
        dataset, slow_stager):
    """Cancelling the stager must not wait for a copy thread to finish its chunk (up to
    2 GiB in production): the copy stops at its next step, its temp file is removed
    and nothing half-copied is published."""
    owned = np.zeros(dataset.chunk_count, dtype=bool)
    owned[0] = True
    stager = slow_stager(owned, jobs=1)
    cache = stager.caches[0]

    def copy_under_way() -> bool:  # a temp file with a step of the chunk in it
        for entry in os.scandir(cache.dir):
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_size > 0:
                    return True
        return False

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stager.run)
        assert await until(copy_under_way, 10), "the copy never started"
        cancelled = time.monotonic()
        nursery.cancel_scope.cancel()
    waited = time.monotonic() - cancelled
    # The copy stops after its step (0.5 s); the rest of the chunk would take 7 s more.
    assert waited < 4, f"the unmount waited {waited:.2f} s for a copy in flight"
    assert copies_and_temp_files(cache.dir) == []
    assert not cache.is_staged(0)


def test_a_copy_stopped_by_unmount_removes_its_temp_file(dataset, tmp_path):
    """A copy the stop flag interrupts is abandoned whole: no `.tmp-` file stays in the
    cache directory and no copy is published."""
    cache = ChunkCache(tmp_path / "cache", dataset)
    cache.scan()
    demand = DemandChannel()
    stager = Stager([dataset], [cache], [np.ones(dataset.chunk_count, dtype=bool)], demand)
    try:
        stager._stopping = True  # what cancelling `run` does
        stager._copy(0, 0, bytearray())
        assert copies_and_temp_files(cache.dir) == []
        assert not cache.is_staged(0) and stager.copied_chunks == 0
    finally:
        cache.close()
        demand.close()


# -- the blocking peer client ---------------------------------------------------------

@pytest.fixture
def start_peer(tmp_path):
    """start(chunks, **server_kwargs) -> a running PeerLoopServer; all stop afterwards."""
    running = []

    def start(chunks: list[bytes], **server_kwargs) -> PeerLoopServer:
        provider = FileProvider(tmp_path / f"peer{len(running)}", chunks)
        server = PeerLoopServer(SECRET, provider, "server-node", **server_kwargs)
        server.port = server.start("127.0.0.1", 0)
        running.append(server)
        return server

    yield start
    for server in running:
        server.stop()
        server.provider.close()


def blocking_client(port: int, timeout: float = 2.0) -> BlockingPeerClient:
    return BlockingPeerClient(SECRET, "worker", "127.0.0.1", port, timeout=timeout)


def test_a_connection_the_server_closed_while_idle_is_replaced_not_a_failure(start_peer):
    """The server closes a connection idle for idle_timeout (or its daemon restarted): the
    next read goes out on a new connection instead of marking a healthy peer down."""
    data = os.urandom(100_000)
    server = start_peer([data], idle_timeout=0.2)
    client = blocking_client(server.port)
    try:
        assert client.read(DATASET, 0, 0, 1000) == data[:1000]
        deadline = time.monotonic() + 3
        while server.counters()["connections_open"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.counters()["connections_open"] == 0, "the server kept it open"
        assert client.read(DATASET, 0, 500, 2000) == data[500:2500]
        assert server.counters()["connections_accepted"] == 2
    finally:
        client.close()
    server.stop()  # gone for real: still a failure, on the kept and on a new connection
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        client.read(DATASET, 0, 0, 10)


async def serve_fake(nursery: trio.Nursery, handler) -> int:
    """A trio TCP server running `handler(stream, connection_number)`; returns its port."""
    count = 0

    async def numbered(stream: trio.SocketStream) -> None:
        nonlocal count
        count += 1
        async with stream:
            await handler(stream, count)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, numbered, 0,
                                                      host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1]


async def handshake_and_request(stream: trio.SocketStream) -> protocol.Message:
    """The server's side of a correct handshake; returns the first request."""
    decoder = protocol.FrameDecoder()

    async def message() -> protocol.Message:
        while True:
            got = decoder.feed(await stream.receive_some())
            if got:
                return got[0]

    hello = await message()
    nonce = protocol.new_nonce()
    await stream.send_all(protocol.encode(protocol.challenge(
        nonce, protocol.server_proof(SECRET, hello["nonce"], nonce))))
    await message()  # AUTH
    await stream.send_all(protocol.encode(protocol.ok()))
    return await message()


async def test_a_reply_cut_short_or_a_new_connection_closed_is_not_retried(nursery):
    """Only a kept connection that fails before any byte of the reply is replaced: a reply
    that broke off half-way, or a fresh connection that fails, is a failure."""
    async def half_a_reply(stream: trio.SocketStream, number: int) -> None:
        read = await handshake_and_request(stream)
        frame = protocol.encode(protocol.data(read["id"], bytes(read["len"])))
        await stream.send_all(frame[: len(frame) // 2])

    port = await serve_fake(nursery, half_a_reply)
    client = blocking_client(port, timeout=1.0)
    with pytest.raises(PeerUnavailable, match="closed by the peer"):
        await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 1000)  # fresh
    with pytest.raises(PeerUnavailable, match="closed by the peer"):
        await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 1000)  # fresh again
    client.close()

    async def closes_at_once(stream: trio.SocketStream, number: int) -> None:
        await handshake_and_request(stream)

    port = await serve_fake(nursery, closes_at_once)
    client = blocking_client(port, timeout=1.0)
    with pytest.raises(PeerUnavailable, match="closed by the peer"):
        await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 1000)
    client.close()


async def test_the_retry_on_a_new_connection_keeps_the_reads_deadline(nursery):
    """The kept connection is closed only after a while, and the new one never finishes
    its handshake: the read still fails within its one timeout."""
    async def server(stream: trio.SocketStream, number: int) -> None:
        if number > 1:
            await trio.sleep_forever()  # silent: no CHALLENGE
        read = await handshake_and_request(stream)
        await stream.send_all(protocol.encode(protocol.data(read["id"], bytes(read["len"]))))
        await stream.receive_some()  # the second request ...
        await trio.sleep(3.5)  # ... is dropped late: the connection just closes

    port = await serve_fake(nursery, server)
    client = blocking_client(port, timeout=4.0)
    assert await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 10) == bytes(10)
    started = time.monotonic()
    with pytest.raises(PeerUnavailable, match="after the connection in use was lost"):
        await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 10)
    # One 4 s timeout in all; a retry with a timeout of its own would end at 3.5 + 4 s.
    assert time.monotonic() - started < 6
    client.close()


def test_clients_of_one_process_share_one_receive_buffer(start_peer):
    """A worker talking to N peers holds one 4 MiB receive buffer, not N; reads through
    each client still return that peer's bytes."""
    chunks_a = [os.urandom(protocol.MAX_READ + 100), os.urandom(5000)]
    chunks_b = [os.urandom(protocol.MAX_READ + 100), os.urandom(5000)]
    a = blocking_client(start_peer(chunks_a).port)
    b = blocking_client(start_peer(chunks_b).port)
    try:
        shared = a._view.obj is b._view.obj
        assert shared, "each client has its own receive buffer"
        for chunk, offset, length in [(0, 0, protocol.MAX_READ), (1, 10, 4000),
                                      (0, 100, protocol.MAX_READ), (1, 0, 5000)]:
            got_a = bytes(a.read(DATASET, chunk, offset, length))
            got_b = bytes(b.read(DATASET, chunk, offset, length))
            assert got_a == chunks_a[chunk][offset:offset + length]
            assert got_b == chunks_b[chunk][offset:offset + length]
    finally:
        a.close()
        b.close()


async def test_a_version_1_peer_is_read_in_version_1_and_told_no_reports(nursery):
    """An older daemon of the job refuses protocol version 2: the client connects again
    speaking version 1, keeps to it, and sends it no REPORT (version 1 has none)."""
    chunk = os.urandom(5000)
    hellos: list[int] = []
    port = await serve_fake(nursery, lambda stream, number: version_1_server(stream, hellos,
                                                                              chunk))
    client = blocking_client(port)
    try:
        for offset in (0, 100):
            got = await trio.to_thread.run_sync(client.read, DATASET, 0, offset, 1000)
            assert bytes(got) == chunk[offset : offset + 1000]
        assert not client.report(protocol.BadRange(DATASET, 0, 0, 1000))
        client.close()  # a new connection starts in version 1 right away
        assert bytes(await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 10)) == \
            chunk[:10]
    finally:
        client.close()
    assert hellos == [2, 1, 1]

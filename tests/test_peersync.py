"""BlockingPeerClient (what worker processes use) against a real PeerServer on loopback.

The server runs in this test's trio loop; every blocking client call runs in a
thread (trio.to_thread) so the loop keeps serving.
"""

from __future__ import annotations

import pytest
import trio
from test_peer import (
    CHUNKS,
    DATASET,
    FAILING,
    NOT_STAGED,
    SECRET,
    UNKNOWN_DATASET,
    WRONG_SECRET,
    start_peer,
)

from dlfsd.peer import PeerMiss, PeerRefused, PeerUnavailable
from dlfsd.peersync import BlockingPeerClient


def client_for(port: int, secret: bytes = SECRET, timeout: float = 2.0) -> BlockingPeerClient:
    return BlockingPeerClient(secret, "worker", "127.0.0.1", port, timeout=timeout)


async def call(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


async def test_reads_exact_ranges_over_one_reused_connection(nursery):
    peer = await start_peer(nursery)
    client = client_for(peer.port)
    try:
        for chunk, offset, length in [(0, 0, 100_000), (0, 99_999, 1), (1, 12_345, 4 << 20),
                                      (2, 0, 7)]:
            got = await call(client.read, DATASET, chunk, offset, length)
            assert got == CHUNKS[chunk][offset:offset + length]
        assert peer.server.connections_accepted == 1
        assert peer.server.bytes_served == 100_000 + 1 + (4 << 20) + 7
    finally:
        client.close()


async def test_miss_refusal_and_io_error_keep_the_connection(nursery):
    peer = await start_peer(nursery)
    client = client_for(peer.port)
    try:
        with pytest.raises(PeerMiss):
            await call(client.read, DATASET, NOT_STAGED, 0, 10)
        with pytest.raises(PeerMiss):
            await call(client.read, DATASET, FAILING, 0, 10)
        for args in [(UNKNOWN_DATASET, 0, 0, 10), (DATASET, 0, 99_990, 11), (DATASET, 9, 0, 1)]:
            with pytest.raises(PeerRefused):
                await call(client.read, *args)
        assert await call(client.read, DATASET, 2, 1, 3) == CHUNKS[2][1:4]
        assert peer.server.connections_accepted == 1
    finally:
        client.close()


async def test_wrong_secret_gets_nothing(nursery):
    peer = await start_peer(nursery)
    client = client_for(peer.port, WRONG_SECRET)
    with pytest.raises(PeerUnavailable, match=r"authentication|handshake"):
        await call(client.read, DATASET, 0, 0, 10)
    await trio.sleep(0.1)  # let the server finish its side of the handshake
    assert peer.server.bytes_served == 0
    assert peer.server.auth_failures == 1


async def test_dead_or_silent_peer_fails_within_the_timeout(nursery):
    peer = await start_peer(nursery)
    client = client_for(peer.port, timeout=0.5)
    assert await call(client.read, DATASET, 0, 0, 10) == CHUNKS[0][:10]
    peer.provider.delay = 5.0  # silent: the reply never comes in time
    started = trio.current_time()
    with pytest.raises(PeerUnavailable, match=r"no answer within 0\.5 s"):
        await call(client.read, DATASET, 0, 0, 10)
    assert trio.current_time() - started < 2.0
    peer.provider.delay = 0.0
    assert await call(client.read, DATASET, 0, 10, 10) == CHUNKS[0][10:20]  # reconnects
    peer.scope.cancel()  # dead: the server is gone
    await trio.sleep(0.1)
    client.close()
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        await call(client.read, DATASET, 0, 0, 10)

"""BlockingPeerClient (what worker processes use) against the daemon's PeerLoopServer.

The server runs on its own thread, as in the daemon, so the blocking client
is called straight from the test.
"""

from __future__ import annotations

import threading
import time

import pytest
from test_peer import (
    CHUNKS,
    DATASET,
    FAILING,
    NOT_STAGED,
    SECRET,
    UNKNOWN_DATASET,
    WRONG_SECRET,
    FileProvider,
)

from dlfsd.peer import PeerMiss, PeerRefused, PeerUnavailable
from dlfsd.peerserver import PeerLoopServer
from dlfsd.peersync import BlockingPeerClient


@pytest.fixture
def server(tmp_path):
    provider = FileProvider(tmp_path)
    s = PeerLoopServer(SECRET, provider, "server-node", handshake_timeout=1.0)
    s.port = s.start("127.0.0.1", 0)
    yield s
    if provider.gate is not None:
        provider.gate.set()
    s.stop()
    provider.close()


def client_for(server, secret: bytes = SECRET, timeout: float = 2.0) -> BlockingPeerClient:
    return BlockingPeerClient(secret, "worker", "127.0.0.1", server.port, timeout=timeout)


def test_reads_exact_ranges_over_one_reused_connection(server):
    client = client_for(server)
    try:
        for chunk, offset, length in [(0, 0, 100_000), (0, 99_999, 1), (1, 12_345, 4 << 20),
                                      (2, 0, 7)]:
            assert client.read(DATASET, chunk, offset, length) == \
                CHUNKS[chunk][offset:offset + length]
        counts = server.counters()
        assert counts["connections_accepted"] == 1
        assert counts["bytes_served"] == 100_000 + 1 + (4 << 20) + 7
    finally:
        client.close()


def test_miss_refusal_and_io_error_keep_the_connection(server):
    client = client_for(server)
    try:
        with pytest.raises(PeerMiss):
            client.read(DATASET, NOT_STAGED, 0, 10)
        with pytest.raises(PeerMiss):
            client.read(DATASET, FAILING, 0, 10)
        for args in [(UNKNOWN_DATASET, 0, 0, 10), (DATASET, 0, 99_990, 11), (DATASET, 9, 0, 1)]:
            with pytest.raises(PeerRefused):
                client.read(*args)
        assert client.read(DATASET, 2, 1, 3) == CHUNKS[2][1:4]
        assert server.counters()["connections_accepted"] == 1
    finally:
        client.close()


def test_wrong_secret_gets_nothing(server):
    client = client_for(server, WRONG_SECRET)
    with pytest.raises(PeerUnavailable, match=r"authentication|handshake"):
        client.read(DATASET, 0, 0, 10)
    deadline = time.monotonic() + 5  # the server thread finishes its side after we left
    while server.counters()["auth_failures"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.counters()["auth_failures"] == 1
    assert server.counters()["bytes_served"] == 0


def test_dead_or_silent_peer_fails_within_the_timeout(server):
    client = client_for(server, timeout=0.5)
    assert client.read(DATASET, 0, 0, 10) == CHUNKS[0][:10]
    stuck = server.provider.gate = threading.Event()  # silent: the reply does not come
    started = time.monotonic()
    with pytest.raises(PeerUnavailable, match=r"no answer within 0\.5 s"):
        client.read(DATASET, 0, 0, 10)
    assert time.monotonic() - started < 2.0
    server.provider.gate = None
    stuck.set()
    assert client.read(DATASET, 0, 10, 10) == CHUNKS[0][10:20]  # on a new connection
    assert server.counters()["connections_accepted"] == 2
    server.stop()  # dead: the server is gone
    started = time.monotonic()
    with pytest.raises(PeerUnavailable, match="closed by the peer"):
        client.read(DATASET, 0, 0, 10)  # on the connection the server closed
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        client.read(DATASET, 0, 0, 10)
    assert time.monotonic() - started < 0.5  # neither waits for the timeout
    client.close()

"""dlfsd.peer: a real PeerServer on loopback, real PeerClients and hostile raw sockets.

The provider is an in-memory stand-in for the daemon's chunk cache (it is what
the server reads from, not what is under test).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import struct

import pytest
import trio

from dlfs import protocol
from dlfsd.peer import PeerClient, PeerMiss, PeerRefused, PeerServer, PeerUnavailable

SECRET = b"job-secret-0123456789abcdef"
WRONG_SECRET = b"another-jobs-secret-0123456789"
DATASET = os.urandom(16)
UNKNOWN_DATASET = os.urandom(16)
CHUNKS = [os.urandom(100_000), os.urandom(protocol.MAX_READ + 12_345), os.urandom(7)]
NOT_STAGED = 3  # a valid chunk index this node has not staged
FAILING = 4  # a chunk whose local copy cannot be read
CHUNK_LENGTHS = [len(c) for c in CHUNKS] + [50_000, 50_000]


class MemoryProvider:
    """Chunks of one dataset in memory; can be made slow, and counts concurrency."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.gate: trio.Event | None = None  # reads wait for it when set
        self.in_flight = 0
        self.max_in_flight = 0

    def chunk_limit(self, dataset_id: bytes, chunk: int) -> int | None:
        if dataset_id != DATASET or chunk >= len(CHUNK_LENGTHS):
            return None
        return CHUNK_LENGTHS[chunk]

    async def read_staged(self, dataset_id: bytes, chunk: int, offset: int,
                          length: int) -> bytes | None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await trio.sleep(self.delay)
            if chunk == FAILING:
                raise OSError(5, "Input/output error")
            if chunk >= len(CHUNKS):
                return None
            return CHUNKS[chunk][offset:offset + length]
        finally:
            self.in_flight -= 1


class Peer:
    """A running server and how to reach it."""

    def __init__(self, server: PeerServer, provider: MemoryProvider, port: int,
                 scope: trio.CancelScope) -> None:
        self.server, self.provider, self.port, self.scope = server, provider, port, scope

    def client(self, secret: bytes = SECRET, **kwargs) -> PeerClient:
        return PeerClient(secret, "client-node", "127.0.0.1", self.port, **kwargs)


async def start_peer(nursery: trio.Nursery, port: int = 0, **server_kwargs) -> Peer:
    provider = MemoryProvider()
    server = PeerServer(SECRET, provider, "server-node", **server_kwargs)
    scope = trio.CancelScope()

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        with scope:
            await server.serve("127.0.0.1", port, task_status=task_status)

    port = await nursery.start(run)
    return Peer(server, provider, port, scope)


@pytest.fixture
async def peer(nursery):
    return await start_peer(nursery, handshake_timeout=1.0)


async def assert_serves_a_good_client(peer: Peer) -> None:
    client = peer.client(connections=1)
    try:
        assert await client.read(DATASET, 0, 1000, 5000) == CHUNKS[0][1000:6000]
    finally:
        await client.aclose()


# -- raw-socket helpers for hostile peers --------------------------------------

async def raw_connect(peer: Peer) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", peer.port)


async def receive_until_closed(stream: trio.SocketStream, limit: float = 3.0) -> list[dict]:
    """Everything the server sends before it closes the connection (fails on a hang)."""
    received = bytearray()
    with trio.fail_after(limit):
        while chunk := await stream.receive_some():
            received += chunk
    return protocol.FrameDecoder().feed(received)


async def raw_handshake(stream: trio.SocketStream, secret: bytes = SECRET) -> None:
    """Authenticate by hand, so the test can misbehave afterwards."""
    decoder = protocol.FrameDecoder()
    client_nonce = protocol.new_nonce()
    await stream.send_all(protocol.encode(protocol.hello("raw", client_nonce)))
    (challenge,) = decoder.feed(await stream.receive_some())
    await stream.send_all(protocol.encode(protocol.auth(protocol.client_proof(
        secret, challenge["nonce"], client_nonce))))
    (ok,) = decoder.feed(await stream.receive_some())
    assert ok == protocol.ok()


# -- good clients ----------------------------------------------------------------

async def test_reads_exact_ranges(peer):
    client = peer.client(connections=1)
    ranges = [(0, 0, 1), (0, 0, len(CHUNKS[0])), (0, 99_999, 1), (1, 0, protocol.MAX_READ),
              (1, len(CHUNKS[1]) - protocol.MAX_READ, protocol.MAX_READ), (1, 4095, 8193),
              (2, 0, 7)]
    for chunk, offset, length in ranges:
        got = await client.read(DATASET, chunk, offset, length)
        assert got == CHUNKS[chunk][offset:offset + length]
    await client.aclose()
    assert peer.server.connections_accepted == 1
    assert peer.server.reads_served == len(ranges)
    assert peer.server.bytes_served == sum(length for _, _, length in ranges)
    assert peer.server.auth_failures == peer.server.protocol_errors == 0


async def test_many_concurrent_pipelined_reads_from_several_tasks(peer):
    peer.provider.delay = 0.002  # long enough for requests to overlap
    client = peer.client(connections=2)
    rng = random.Random(7)
    jobs = []
    for _ in range(8):
        task_ranges = []
        for _ in range(40):
            chunk = rng.randrange(2)
            length = rng.randrange(1, 70_000)
            task_ranges.append((chunk, rng.randrange(len(CHUNKS[chunk]) - length + 1), length))
        jobs.append(task_ranges)
    mismatches = []

    async def reader(task_ranges):
        for chunk, offset, length in task_ranges:
            if await client.read(DATASET, chunk, offset, length) != \
                    CHUNKS[chunk][offset:offset + length]:
                mismatches.append((chunk, offset, length))

    async with trio.open_nursery() as nursery:
        for task_ranges in jobs:
            nursery.start_soon(reader, task_ranges)
    await client.aclose()
    assert mismatches == []
    assert peer.server.connections_accepted == 2
    assert peer.server.reads_served == 8 * 40
    assert peer.server.bytes_served == sum(r[2] for job in jobs for r in job)
    # Pipelined: more than one read per connection was in progress at once.
    assert 2 < peer.provider.max_in_flight <= 2 * peer.server.max_in_flight


async def test_server_limits_reads_in_flight_per_connection(nursery):
    peer = await start_peer(nursery, max_in_flight=3)
    peer.provider.gate = trio.Event()
    client = peer.client(connections=1)
    results = []

    async def reader(i):
        results.append(await client.read(DATASET, 0, i, 10) == CHUNKS[0][i:i + 10])

    async with trio.open_nursery() as readers:
        for i in range(10):
            readers.start_soon(reader, i)
        await trio.sleep(0.2)
        assert peer.provider.in_flight == 3
        peer.provider.gate.set()
    assert results == [True] * 10
    await client.aclose()


async def test_refused_ranges_raise_peer_refused_and_keep_the_connection(peer):
    client = peer.client(connections=1)
    cases = [
        (UNKNOWN_DATASET, 0, 0, 1, protocol.FAIL_UNKNOWN_CHUNK),
        (DATASET, len(CHUNK_LENGTHS), 0, 1, protocol.FAIL_UNKNOWN_CHUNK),
        (DATASET, 2**40, 0, 1, protocol.FAIL_UNKNOWN_CHUNK),
        (DATASET, 0, len(CHUNKS[0]), 1, protocol.FAIL_OUT_OF_RANGE),
        (DATASET, 0, len(CHUNKS[0]) - 10, 11, protocol.FAIL_OUT_OF_RANGE),
        (DATASET, 0, 2**64 - 1, 1, protocol.FAIL_OUT_OF_RANGE),
        (DATASET, 0, 0, 0, protocol.FAIL_BAD_LENGTH),
        (DATASET, 1, 0, protocol.MAX_READ + 1, protocol.FAIL_BAD_LENGTH),
    ]
    for dataset_id, chunk, offset, length, code in cases:
        with pytest.raises(PeerRefused) as refused:
            await client.read(dataset_id, chunk, offset, length)
        assert refused.value.code == code
    assert await client.read(DATASET, 2, 0, 7) == CHUNKS[2]
    await client.aclose()
    assert peer.server.connections_accepted == 1
    assert peer.server.reads_refused == len(cases)
    assert peer.server.bytes_served == 7
    assert peer.server.protocol_errors == 0


async def test_arguments_the_wire_cannot_carry_are_caller_bugs(peer):
    client = peer.client()
    for args in [(b"short", 0, 0, 1), (DATASET, -1, 0, 1), (DATASET, 0, -5, 1),
                 (DATASET, 0, 0, 1.5)]:
        with pytest.raises(ValueError):
            await client.read(*args)
    assert peer.server.connections_accepted == 0


async def test_chunk_not_staged_raises_peer_miss(peer):
    client = peer.client()
    with pytest.raises(PeerMiss) as missed:
        await client.read(DATASET, NOT_STAGED, 0, 100)
    assert missed.value.code is None
    await client.aclose()
    assert peer.server.reads_missed == 1
    assert peer.server.bytes_served == 0


async def test_provider_error_is_one_failed_read_and_one_log_line(peer, caplog):
    client = peer.client(connections=1)
    with caplog.at_level(logging.WARNING, logger="dlfsd.peer"), \
            pytest.raises(PeerMiss) as failed:
        await client.read(DATASET, FAILING, 0, 100)
    assert failed.value.code == protocol.FAIL_IO
    records = [r for r in caplog.records if r.name == "dlfsd.peer"]
    assert len(records) == 1
    assert "Input/output error" in records[0].getMessage()
    assert "127.0.0.1:" in records[0].getMessage()
    assert await client.read(DATASET, 0, 0, 3) == CHUNKS[0][:3]  # same connection still works
    await client.aclose()
    assert peer.server.read_errors == 1
    assert peer.server.connections_accepted == 1


# -- authentication ----------------------------------------------------------------

async def test_wrong_secret_gets_nothing(peer):
    client = peer.client(secret=WRONG_SECRET)
    with pytest.raises(PeerUnavailable, match="authentication"):
        await client.read(DATASET, 0, 0, 100)
    await client.aclose()
    await trio.sleep(0.05)  # let the server finish with the connection
    assert peer.server.auth_failures == 1
    assert peer.server.bytes_served == 0
    await assert_serves_a_good_client(peer)


async def test_wrong_client_proof_gets_err_and_close(peer, caplog):
    stream = await raw_connect(peer)
    decoder = protocol.FrameDecoder()
    await stream.send_all(protocol.encode(protocol.hello("intruder", protocol.new_nonce())))
    (challenge,) = decoder.feed(await stream.receive_some())
    assert challenge["t"] == protocol.CHALLENGE
    await stream.send_all(protocol.encode(protocol.auth(b"\0" * protocol.PROOF_SIZE)))
    with caplog.at_level(logging.WARNING, logger="dlfsd.peer"):
        replies = await receive_until_closed(stream)
    assert [(m["t"], m["code"]) for m in replies] == [(protocol.ERR, protocol.ERR_AUTH)]
    assert peer.server.auth_failures == 1
    assert peer.server.bytes_served == 0
    assert any("intruder" in r.getMessage() for r in caplog.records)
    await assert_serves_a_good_client(peer)


async def test_server_with_wrong_secret_is_not_trusted(nursery):
    impostor = await start_peer(nursery)
    client = PeerClient(WRONG_SECRET, "client-node", "127.0.0.1", impostor.port)
    with pytest.raises(PeerUnavailable, match="different job secret"):
        await client.read(DATASET, 0, 0, 10)
    await trio.sleep(0.05)
    assert impostor.server.auth_failures == 1  # the client told it why it left
    assert impostor.provider.max_in_flight == 0


async def test_read_before_handshake_closes_the_connection(peer):
    stream = await raw_connect(peer)
    await stream.send_all(protocol.encode(protocol.read(1, DATASET, 0, 0, 100)))
    replies = await receive_until_closed(stream)
    assert [m["t"] for m in replies] == [protocol.ERR]
    assert peer.server.protocol_errors == 1
    assert peer.server.bytes_served == 0
    assert peer.provider.max_in_flight == 0
    await assert_serves_a_good_client(peer)


async def test_read_instead_of_auth_closes_the_connection(peer):
    stream = await raw_connect(peer)
    decoder = protocol.FrameDecoder()
    await stream.send_all(protocol.encode(protocol.hello("raw", protocol.new_nonce())))
    (challenge,) = decoder.feed(await stream.receive_some())
    assert challenge["t"] == protocol.CHALLENGE
    await stream.send_all(protocol.encode(protocol.read(1, DATASET, 0, 0, 100)))
    replies = await receive_until_closed(stream)
    assert [m["t"] for m in replies] == [protocol.ERR]
    assert peer.server.protocol_errors == 1
    assert peer.server.bytes_served == 0
    await assert_serves_a_good_client(peer)


async def test_unknown_version_gets_err_version(peer):
    stream = await raw_connect(peer)
    await stream.send_all(protocol.encode(protocol.hello("future", protocol.new_nonce(),
                                                         version=2)))
    replies = await receive_until_closed(stream)
    assert [(m["t"], m["code"]) for m in replies] == [(protocol.ERR, protocol.ERR_VERSION)]
    assert peer.server.protocol_errors == 1
    await assert_serves_a_good_client(peer)


async def test_silent_connection_is_dropped_after_the_handshake_timeout(nursery):
    peer = await start_peer(nursery, handshake_timeout=0.2)
    stream = await raw_connect(peer)
    start = trio.current_time()
    assert await receive_until_closed(stream) == []
    assert 0.15 < trio.current_time() - start < 2.0
    assert peer.server.protocol_errors == 1
    await assert_serves_a_good_client(peer)


# -- malformed traffic ----------------------------------------------------------------

@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",             # a length prefix of ~1.2 GB
    struct.pack(">I", 5) + b"hello",                 # msgpack int plus junk
    struct.pack(">I", 3) + b"\x93\x01\x02",          # truncated array
    struct.pack(">I", protocol.MAX_CONTROL_FRAME + 1),  # oversized, no body sent
    struct.pack(">I", 2) + b"\x80\xc1",              # empty map plus a never-used byte
], ids=["http", "int", "truncated", "oversized", "junk"])
@pytest.mark.parametrize("authenticated", [False, True], ids=["before-auth", "after-auth"])
async def test_malformed_frames_close_the_connection(peer, caplog, garbage, authenticated):
    stream = await raw_connect(peer)
    if authenticated:
        await raw_handshake(stream)
    with caplog.at_level(logging.WARNING, logger="dlfsd.peer"):
        await stream.send_all(garbage)
        if garbage.startswith(struct.pack(">I", 3)):
            await stream.send_eof()  # the server sees a frame cut short
        replies = await receive_until_closed(stream)
    assert all(m["t"] == protocol.ERR for m in replies)
    assert peer.server.protocol_errors == 1
    assert peer.server.bytes_served == 0
    warnings = [r for r in caplog.records if r.name == "dlfsd.peer"]
    assert len(warnings) == 1 and "127.0.0.1:" in warnings[0].getMessage()
    await assert_serves_a_good_client(peer)


async def test_unexpected_message_after_auth_closes_the_connection(peer):
    stream = await raw_connect(peer)
    await raw_handshake(stream)
    await stream.send_all(protocol.encode(protocol.data(1, b"unsolicited")))
    assert [m["t"] for m in await receive_until_closed(stream)] == [protocol.ERR]
    assert peer.server.protocol_errors == 1
    await assert_serves_a_good_client(peer)


async def test_connections_beyond_the_limit_are_refused(nursery):
    peer = await start_peer(nursery, max_connections=1)
    holder = await raw_connect(peer)
    await raw_handshake(holder)
    extra = await raw_connect(peer)
    assert await receive_until_closed(extra) == []
    assert peer.server.connections_rejected == 1
    await holder.aclose()
    await trio.sleep(0.05)
    await assert_serves_a_good_client(peer)


# -- failures seen by the client ----------------------------------------------------------

async def test_nothing_listening_is_unavailable():
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # the port is now (almost certainly) closed
    client = PeerClient(SECRET, "client-node", "127.0.0.1", port)
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        await client.read(DATASET, 0, 0, 1)


async def test_server_stopped_mid_request_fails_fast_and_reconnects_later(nursery):
    peer = await start_peer(nursery)
    client = peer.client(connections=1, timeout=5.0)
    assert await client.read(DATASET, 0, 0, 10) == CHUNKS[0][:10]
    peer.provider.gate = trio.Event()  # the next read hangs in the server
    start = trio.current_time()
    async with trio.open_nursery() as waiting:
        async def stop_server_soon():
            await trio.sleep(0.1)
            peer.scope.cancel()
        waiting.start_soon(stop_server_soon)
        with pytest.raises(PeerUnavailable):
            await client.read(DATASET, 0, 0, 10)
    assert trio.current_time() - start < 1.0  # the lost connection, not the timeout
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        await client.read(DATASET, 0, 0, 10)
    await client.aclose()


async def test_slow_provider_times_out_and_the_late_reply_is_dropped(peer):
    client = peer.client(connections=1, timeout=0.3)
    stuck = peer.provider.gate = trio.Event()
    start = trio.current_time()
    with pytest.raises(PeerUnavailable, match="did not answer"):
        await client.read(DATASET, 1, 0, 1000)
    assert 0.25 < trio.current_time() - start < 1.0
    peer.provider.gate = None  # new reads are fast; the stuck one still waits
    assert await client.read(DATASET, 0, 0, 1000) == CHUNKS[0][:1000]
    stuck.set()  # its late reply arrives now and must be dropped quietly
    await trio.sleep(0.05)
    assert peer.server.reads_served == 2
    assert await client.read(DATASET, 2, 0, 7) == CHUNKS[2]
    await client.aclose()
    assert peer.server.connections_accepted == 1


async def test_many_tasks_share_one_connect_and_all_fail_within_the_timeout():
    # A listener that accepts but never answers: a hung peer.
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    client = PeerClient(SECRET, "client-node", "127.0.0.1", port, timeout=0.3)
    failures = []

    async def reader():
        try:
            await client.read(DATASET, 0, 0, 1)
        except PeerUnavailable as error:
            failures.append(error)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(reader)
    assert len(failures) == 10
    assert trio.current_time() - start < 1.5
    await client.aclose()
    listener.close()


async def test_closed_client_fails_pending_and_later_reads(peer):
    client = peer.client(connections=1)
    peer.provider.gate = trio.Event()
    outcome = []

    async def reader():
        try:
            await client.read(DATASET, 0, 0, 10)
        except PeerUnavailable:
            outcome.append("unavailable")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.sleep(0.1)
        await client.aclose()
    assert outcome == ["unavailable"]
    with pytest.raises(PeerUnavailable, match="closed"):
        await client.read(DATASET, 0, 0, 10)


@pytest.mark.parametrize("reply", [
    lambda read: protocol.encode(protocol.data(read["id"], b"x" * (read["len"] + 1))),
    lambda read: protocol.encode(protocol.data(read["id"] + 1, b"x" * read["len"])),
    lambda read: protocol.encode(protocol.ok()),
    lambda read: b"\xff\xff\xff\xff",
], ids=["wrong-length", "unknown-id", "unexpected-type", "garbage"])
async def test_a_misbehaving_server_is_unavailable_never_wrong_bytes(nursery, reply):
    """A server that authenticates correctly but then answers nonsense."""

    async def fake_server(stream):
        decoder = protocol.FrameDecoder()
        (hello,) = decoder.feed(await stream.receive_some())
        server_nonce = protocol.new_nonce()
        await stream.send_all(protocol.encode(protocol.challenge(
            server_nonce, protocol.server_proof(SECRET, hello["nonce"], server_nonce))))
        decoder.feed(await stream.receive_some())  # AUTH (not checked here)
        await stream.send_all(protocol.encode(protocol.ok()))
        (read,) = decoder.feed(await stream.receive_some())
        await stream.send_all(reply(read))
        await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, fake_server, 0,
                                                      host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    client = PeerClient(SECRET, "client-node", "127.0.0.1", port, timeout=2.0)
    start = trio.current_time()
    with pytest.raises(PeerUnavailable):
        await client.read(DATASET, 0, 0, 10)
    assert trio.current_time() - start < 1.0
    await client.aclose()


def test_a_client_used_from_a_new_trio_run_opens_its_own_connections():
    """Forked daemon workers each call trio.run; a client must not carry a run's state over."""
    ports = []
    client = None

    async def one_run():
        nonlocal client
        async with trio.open_nursery() as nursery:
            peer = await start_peer(nursery, port=ports[0] if ports else 0)
            ports.append(peer.port)
            if client is None:
                client = peer.client()
            assert await client.read(DATASET, 0, 5, 10) == CHUNKS[0][5:15]
            assert peer.server.connections_accepted == 1
            nursery.cancel_scope.cancel()  # no aclose: the run ends with the connection open

    trio.run(one_run)
    trio.run(one_run)
    assert ports[0] == ports[1]

"""The daemon's peer client (BlockingPeerClient) against its PeerLoopServer on
loopback, hostile raw sockets against the server, and fake servers that misbehave
against the client.

The provider (peerfakes.FileProvider) stands in for the daemon's chunk pool; made
slow or stuck, it stalls the server's loop thread: that is how these tests make a
server that does not answer.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import socket
import struct
import threading
import time

import pytest
import trio
from peerfakes import DATASET, SECRET, FileProvider

from dlfsd.pool import protocol
from dlfsd.pool.peer import PeerMiss, PeerRefused, PeerUnavailable, PeerUnreachable
from dlfsd.pool.peerserver import PeerLoopServer
from dlfsd.pool.peersync import BlockingPeerClient

WRONG_SECRET = b"another-jobs-secret-0123456789"
UNKNOWN_DATASET = os.urandom(16)
CHUNKS = [os.urandom(100_000), os.urandom(protocol.MAX_READ + 12_345), os.urandom(7)]
NOT_STAGED = 3  # a valid chunk index this node has not staged
FAILING = 4  # a chunk whose local copy cannot be read
CHUNK_LENGTHS = [len(c) for c in CHUNKS] + [50_000, 50_000]


class Peer:
    """A running server and how to reach it."""

    def __init__(self, server: PeerLoopServer, provider: FileProvider, port: int) -> None:
        self.server, self.provider, self.port = server, provider, port

    def client(self, secret: bytes = SECRET, timeout: float = 2.0,
               own_buffer: bool = False) -> BlockingPeerClient:
        return BlockingPeerClient(secret, "client-node", "127.0.0.1", self.port,
                                  timeout=timeout, own_buffer=own_buffer)

    def count(self, name: str) -> int:
        return self.server.counters()[name]

    async def reaches(self, name: str, value: int) -> bool:
        """Wait for a counter the server thread bumps after the client has moved on."""
        with trio.move_on_after(5):
            while self.count(name) != value:
                await trio.sleep(0.01)
        return self.count(name) == value

    def settles_at(self, name: str, value: int) -> bool:
        """reaches(), for tests without a trio loop."""
        deadline = time.monotonic() + 5
        while self.count(name) != value and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.count(name) == value


@pytest.fixture
def start_peer(tmp_path):
    """Start PeerLoopServers (keyword arguments go to it); all stop after the test."""
    running = []

    def start(**server_kwargs) -> Peer:
        provider = FileProvider(tmp_path, CHUNKS, CHUNK_LENGTHS, failing=FAILING)
        server = PeerLoopServer(SECRET, provider, "server-node", **server_kwargs)
        peer = Peer(server, provider, server.start("127.0.0.1", 0))
        running.append(peer)
        return peer

    yield start
    for peer in running:
        if peer.provider.gate is not None:
            peer.provider.gate.set()  # release a server stuck on purpose
        peer.provider.delay = 0.0
        peer.server.stop()
        peer.provider.close()


@pytest.fixture
def peer(start_peer):
    return start_peer(handshake_timeout=1.0)


def assert_serves_a_good_client(peer: Peer) -> None:
    """Blocking, also from a trio test: the server runs on its own thread."""
    client = peer.client()
    try:
        assert client.read(DATASET, 0, 1000, 5000) == CHUNKS[0][1000:6000]
    finally:
        client.close()


# -- raw-socket helpers for hostile peers --------------------------------------

async def raw_connect(peer: Peer) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", peer.port)


async def receive_until_closed(stream: trio.SocketStream, limit: float = 3.0) -> list[dict]:
    """Everything the server sends before it closes the connection (fails on a hang)."""
    received = bytearray()
    with trio.fail_after(limit):
        try:
            while chunk := await stream.receive_some():
                received += chunk
        except trio.BrokenResourceError:  # a reset after the last message counts as closed
            pass
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


async def serve_fake(nursery: trio.Nursery, handler) -> int:
    """A trio TCP server running `handler(stream)` per connection; returns its port."""
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0,
                                                      host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1]


async def fake_handshake(stream: trio.SocketStream, decoder: protocol.FrameDecoder) -> None:
    """The server's side of a correct handshake (the client's proof is not checked)."""
    (hello,) = decoder.feed(await stream.receive_some())
    server_nonce = protocol.new_nonce()
    await stream.send_all(protocol.encode(protocol.challenge(
        server_nonce, protocol.server_proof(SECRET, hello["nonce"], server_nonce))))
    decoder.feed(await stream.receive_some())  # AUTH
    await stream.send_all(protocol.encode(protocol.ok()))


# -- good clients ----------------------------------------------------------------

def test_reads_exact_ranges(peer):
    client = peer.client()
    ranges = [(0, 0, 1), (0, 0, len(CHUNKS[0])), (0, 99_999, 1), (1, 0, protocol.MAX_READ),
              (1, len(CHUNKS[1]) - protocol.MAX_READ, protocol.MAX_READ), (1, 4095, 8193),
              (2, 0, 7)]
    for chunk, offset, length in ranges:
        got = client.read(DATASET, chunk, offset, length)
        assert got == CHUNKS[chunk][offset:offset + length]
    client.close()
    assert peer.count("connections_accepted") == 1
    assert peer.count("reads_served") == len(ranges)
    assert peer.count("bytes_served") == sum(length for _, _, length in ranges)
    assert peer.count("auth_failures") == peer.count("protocol_errors") == 0


def test_many_concurrent_readers_each_get_their_own_bytes(peer):
    """Eight threads, each with a client (and receive buffer) of its own, as the stager's
    copy threads: the server serves the connections at once, no reply goes astray."""
    peer.provider.delay = 0.001  # long enough for requests to queue up behind each other
    rng = random.Random(7)
    jobs = []
    for _ in range(8):
        thread_ranges = []
        for _ in range(40):
            chunk = rng.randrange(2)
            length = rng.randrange(1, 70_000)
            thread_ranges.append((chunk, rng.randrange(len(CHUNKS[chunk]) - length + 1), length))
        jobs.append(thread_ranges)
    mismatches, errors = [], []

    def reader(thread_ranges):
        client = peer.client(timeout=30.0, own_buffer=True)
        try:
            for chunk, offset, length in thread_ranges:
                if client.read(DATASET, chunk, offset, length) != \
                        CHUNKS[chunk][offset:offset + length]:
                    mismatches.append((chunk, offset, length))
        except Exception as error:  # surfaced below: a thread's exception is lost otherwise
            errors.append(error)
        finally:
            client.close()

    threads = [threading.Thread(target=reader, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and mismatches == []
    assert peer.count("connections_accepted") == 8
    assert peer.count("reads_served") == 8 * 40
    assert peer.count("bytes_served") == sum(r[2] for job in jobs for r in job)


async def test_pipelined_reads_on_one_connection_are_answered_by_id(peer):
    """The protocol lets a client send READs without waiting (the daemon's client does
    not, a future one may): every request gets one reply with its id and its bytes."""
    rng = random.Random(11)
    requests = {}
    for request_id in range(40):
        chunk = rng.randrange(2)
        length = rng.randrange(1, 70_000)
        requests[request_id] = (chunk, rng.randrange(len(CHUNKS[chunk]) - length + 1), length)
    requests[40] = (NOT_STAGED, 0, 10)  # a miss and refusals among them
    requests[41] = (0, len(CHUNKS[0]), 1)
    requests[42] = (1, 0, protocol.MAX_READ + 1)  # over MAX_READ: refused, bad length
    stream = await raw_connect(peer)
    await raw_handshake(stream)
    await stream.send_all(b"".join(
        protocol.encode(protocol.read(request_id, DATASET, chunk, offset, length))
        for request_id, (chunk, offset, length) in requests.items()))
    decoder, replies = protocol.FrameDecoder(protocol.MAX_FRAME), []
    with trio.fail_after(10):
        while len(replies) < len(requests):
            replies += decoder.feed(await stream.receive_some())
    await stream.aclose()
    by_id = {reply["id"]: reply for reply in replies}
    assert sorted(by_id) == sorted(requests)  # one reply each, none twice
    for request_id, (chunk, offset, length) in list(requests.items())[:40]:
        assert by_id[request_id]["t"] == protocol.DATA
        assert by_id[request_id]["data"] == CHUNKS[chunk][offset:offset + length]
    assert by_id[40]["t"] == protocol.MISS
    assert (by_id[41]["t"], by_id[41]["code"]) == (protocol.FAIL, protocol.FAIL_OUT_OF_RANGE)
    assert (by_id[42]["t"], by_id[42]["code"]) == (protocol.FAIL, protocol.FAIL_BAD_LENGTH)
    assert peer.count("connections_accepted") == 1
    assert peer.count("reads_served") == 40


def test_refused_ranges_raise_peer_refused_and_keep_the_connection(peer):
    client = peer.client()
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
            client.read(dataset_id, chunk, offset, length)
        assert refused.value.code == code
    assert client.read(DATASET, 2, 0, 7) == CHUNKS[2]
    client.close()
    assert peer.count("connections_accepted") == 1
    assert peer.count("reads_refused") == len(cases)
    assert peer.count("bytes_served") == 7
    assert peer.count("protocol_errors") == 0
    assert peer.provider.lookups == 1  # refused before the provider is asked


def test_chunk_not_staged_raises_peer_miss(peer):
    client = peer.client()
    with pytest.raises(PeerMiss) as missed:
        client.read(DATASET, NOT_STAGED, 0, 100)
    assert missed.value.code is None
    client.close()
    assert peer.count("reads_missed") == 1
    assert peer.count("bytes_served") == 0


def test_provider_errors_fail_the_reads_and_log_one_line_per_chunk(peer, caplog):
    client = peer.client()
    with caplog.at_level(logging.WARNING, logger="dlfsd.pool.peer"):
        for offset in (0, 100, 200):  # a broken copy, read by peers again and again
            with pytest.raises(PeerMiss) as failed:
                client.read(DATASET, FAILING, offset, 100)
            assert failed.value.code == protocol.FAIL_IO
    records = [r for r in caplog.records if r.name == "dlfsd.pool.peer"]
    assert len(records) == 1
    assert "Input/output error" in records[0].getMessage()
    assert "127.0.0.1:" in records[0].getMessage()
    assert f"chunk {FAILING} " in records[0].getMessage()
    assert client.read(DATASET, 0, 0, 3) == CHUNKS[0][:3]  # same connection still works
    client.close()
    assert peer.count("read_errors") == 3
    assert peer.count("connections_accepted") == 1
    assert peer.provider.failed_copies == [(DATASET, FAILING)] * 3  # each asked to evict


# -- authentication ----------------------------------------------------------------

def test_wrong_secret_gets_nothing(peer):
    client = peer.client(secret=WRONG_SECRET)
    with pytest.raises(PeerUnavailable, match="authentication"):
        client.read(DATASET, 0, 0, 100)
    client.close()
    assert peer.settles_at("auth_failures", 1)
    assert peer.count("bytes_served") == 0
    assert_serves_a_good_client(peer)


async def test_wrong_client_proof_gets_err_and_close(peer, caplog):
    stream = await raw_connect(peer)
    decoder = protocol.FrameDecoder()
    await stream.send_all(protocol.encode(protocol.hello("intruder", protocol.new_nonce())))
    (challenge,) = decoder.feed(await stream.receive_some())
    assert challenge["t"] == protocol.CHALLENGE
    with caplog.at_level(logging.WARNING, logger="dlfsd.pool.peer"):
        await stream.send_all(protocol.encode(protocol.auth(b"\0" * protocol.PROOF_SIZE)))
        replies = await receive_until_closed(stream)
    assert [(m["t"], m["code"]) for m in replies] == [(protocol.ERR, protocol.ERR_AUTH)]
    assert peer.count("auth_failures") == 1
    assert peer.count("bytes_served") == 0
    assert any("intruder" in r.getMessage() for r in caplog.records)
    assert_serves_a_good_client(peer)


def test_server_with_wrong_secret_is_not_trusted(start_peer):
    impostor = start_peer()
    client = BlockingPeerClient(WRONG_SECRET, "client-node", "127.0.0.1", impostor.port)
    with pytest.raises(PeerUnavailable, match="different job secret"):
        client.read(DATASET, 0, 0, 10)
    assert impostor.settles_at("auth_failures", 1)  # the client told it why it left
    assert impostor.provider.lookups == 0


async def test_read_before_handshake_closes_the_connection(peer):
    stream = await raw_connect(peer)
    await stream.send_all(protocol.encode(protocol.read(1, DATASET, 0, 0, 100)))
    replies = await receive_until_closed(stream)
    assert [m["t"] for m in replies] == [protocol.ERR]
    assert peer.count("protocol_errors") == 1
    assert peer.count("bytes_served") == 0
    assert peer.provider.lookups == 0
    assert_serves_a_good_client(peer)


async def test_read_instead_of_auth_closes_the_connection(peer):
    stream = await raw_connect(peer)
    decoder = protocol.FrameDecoder()
    await stream.send_all(protocol.encode(protocol.hello("raw", protocol.new_nonce())))
    (challenge,) = decoder.feed(await stream.receive_some())
    assert challenge["t"] == protocol.CHALLENGE
    await stream.send_all(protocol.encode(protocol.read(1, DATASET, 0, 0, 100)))
    replies = await receive_until_closed(stream)
    assert [m["t"] for m in replies] == [protocol.ERR]
    assert peer.count("protocol_errors") == 1
    assert peer.count("bytes_served") == 0
    assert peer.provider.lookups == 0
    assert_serves_a_good_client(peer)


@pytest.mark.parametrize("version", [protocol.PROTOCOL_VERSION + 1,
                                     protocol.MIN_PROTOCOL_VERSION - 1])
async def test_unknown_version_gets_err_version(peer, version):
    stream = await raw_connect(peer)
    await stream.send_all(protocol.encode(protocol.hello("future", protocol.new_nonce(),
                                                         version=version)))
    replies = await receive_until_closed(stream)
    assert [(m["t"], m["code"]) for m in replies] == [(protocol.ERR, protocol.ERR_VERSION)]
    assert peer.count("protocol_errors") == 1
    assert_serves_a_good_client(peer)


async def test_silent_connection_is_dropped_after_the_handshake_timeout(start_peer, caplog):
    peer = start_peer(handshake_timeout=0.2)
    stream = await raw_connect(peer)
    start = trio.current_time()
    with caplog.at_level(logging.WARNING, logger="dlfsd.pool.peer"):
        assert await receive_until_closed(stream) == []
    assert 0.15 < trio.current_time() - start < 2.0
    assert peer.count("protocol_errors") == 1
    assert any("no handshake within" in r.getMessage() for r in caplog.records)
    assert_serves_a_good_client(peer)


async def test_a_handshake_sent_a_byte_at_a_time_still_times_out(start_peer):
    """Trickling bytes must not hold a connection slot past the handshake timeout (256
    such sockets would lock every real peer out)."""
    peer = start_peer(handshake_timeout=0.5)
    stream = await raw_connect(peer)
    start = trio.current_time()
    await stream.send_all(struct.pack(">I", 100))  # a frame of 100 bytes follows...
    closed = False
    for _ in range(20):  # ...one byte every 0.1 s, for up to 2 s
        try:
            await stream.send_all(b"\x01")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            closed = True
            break
        with trio.move_on_after(0.1):
            if await stream.receive_some() == b"":
                closed = True
                break
    assert closed, "still open after 2 s of trickled bytes"
    assert trio.current_time() - start < 1.5
    assert peer.count("protocol_errors") == 1
    assert_serves_a_good_client(peer)


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
    with caplog.at_level(logging.WARNING, logger="dlfsd.pool.peer"):
        await stream.send_all(garbage)
        if garbage.startswith(struct.pack(">I", 3)):
            await stream.send_eof()  # the server sees a frame cut short
        replies = await receive_until_closed(stream)
    assert all(m["t"] == protocol.ERR for m in replies)
    assert peer.count("protocol_errors") == 1
    assert peer.count("bytes_served") == 0
    warnings = [r for r in caplog.records if r.name == "dlfsd.pool.peer"]
    assert len(warnings) == 1 and "127.0.0.1:" in warnings[0].getMessage()
    assert_serves_a_good_client(peer)


async def test_unexpected_message_after_auth_closes_the_connection(peer):
    stream = await raw_connect(peer)
    await raw_handshake(stream)
    await stream.send_all(protocol.encode(protocol.data(1, b"unsolicited")))
    assert [m["t"] for m in await receive_until_closed(stream)] == [protocol.ERR]
    assert peer.count("protocol_errors") == 1
    assert_serves_a_good_client(peer)


async def test_connections_beyond_the_limit_are_refused(start_peer):
    peer = start_peer(max_connections=1)
    holder = await raw_connect(peer)
    await raw_handshake(holder)
    extra = await raw_connect(peer)
    assert await receive_until_closed(extra) == []
    assert peer.count("connections_rejected") == 1
    await holder.aclose()
    assert await peer.reaches("connections_open", 0)
    assert_serves_a_good_client(peer)


# -- failures seen by the client ----------------------------------------------------------

def test_nothing_listening_is_unreachable():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # the port is now (almost certainly) closed
    client = BlockingPeerClient(SECRET, "client-node", "127.0.0.1", port)
    with pytest.raises(PeerUnreachable, match="cannot connect"):
        client.read(DATASET, 0, 0, 1)


async def test_server_gone_mid_request_fails_fast_and_reconnects_later(nursery):
    """A peer that dies with a request pending: the read fails at once, not at the
    timeout, and the next read tries a new connection."""
    server_scope = trio.CancelScope()

    async def dies_at_the_second_request(stream):
        decoder = protocol.FrameDecoder()
        await fake_handshake(stream, decoder)
        (read,) = decoder.feed(await stream.receive_some())
        await stream.send_all(protocol.encode(protocol.data(
            read["id"], CHUNKS[0][read["off"]:read["off"] + read["len"]])))
        assert decoder.feed(await stream.receive_some())  # the second READ: die now
        server_scope.cancel()  # closes the listener and this connection

    async def run_server(task_status=trio.TASK_STATUS_IGNORED):
        with server_scope:
            await trio.serve_tcp(dies_at_the_second_request, 0, host="127.0.0.1",
                                 task_status=task_status)

    listeners = await nursery.start(run_server)
    port = listeners[0].socket.getsockname()[1]
    client = BlockingPeerClient(SECRET, "client-node", "127.0.0.1", port, timeout=30.0)
    assert await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 10) == CHUNKS[0][:10]
    start = trio.current_time()
    with pytest.raises(PeerUnavailable):
        await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 10)
    assert server_scope.cancel_called
    assert trio.current_time() - start < 10.0  # the lost connection, not the 30 s timeout
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 10)
    client.close()


def test_a_peer_that_accepts_and_never_answers_fails_the_read_within_the_timeout():
    """A hung peer (the kernel accepts, nobody reads): the handshake's wait is bounded by
    the read's timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    client = BlockingPeerClient(SECRET, "client-node", "127.0.0.1", port, timeout=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(PeerUnavailable, match=r"handshake .* no answer within 1 s"):
            client.read(DATASET, 0, 0, 1)
        assert 0.9 < time.monotonic() - start < 5.0  # the 1 s timeout, not forever
    finally:
        client.close()
        listener.close()


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
        await fake_handshake(stream, decoder)
        (read,) = decoder.feed(await stream.receive_some())
        await stream.send_all(reply(read))
        await trio.sleep_forever()

    port = await serve_fake(nursery, fake_server)
    client = BlockingPeerClient(SECRET, "client-node", "127.0.0.1", port, timeout=30.0)
    start = trio.current_time()
    with pytest.raises(PeerUnavailable):
        await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 10)
    assert trio.current_time() - start < 10.0  # the nonsense itself, not the 30 s timeout
    client.close()


# -- one connection, kept between reads; timeouts ------------------------------------------

def test_blocking_client_reads_exact_ranges_over_one_reused_connection(peer):
    client = peer.client()
    try:
        for chunk, offset, length in [(0, 0, 100_000), (0, 99_999, 1), (1, 12_345, 4 << 20),
                                      (2, 0, 7)]:
            assert client.read(DATASET, chunk, offset, length) == \
                CHUNKS[chunk][offset:offset + length]
        assert peer.count("connections_accepted") == 1
        assert peer.count("bytes_served") == 100_000 + 1 + (4 << 20) + 7
    finally:
        client.close()


def test_blocking_client_keeps_its_connection_after_miss_refusal_and_io_error(peer):
    client = peer.client()
    try:
        with pytest.raises(PeerMiss):
            client.read(DATASET, NOT_STAGED, 0, 10)
        with pytest.raises(PeerMiss):
            client.read(DATASET, FAILING, 0, 10)
        for args in [(UNKNOWN_DATASET, 0, 0, 10), (DATASET, 0, 99_990, 11), (DATASET, 9, 0, 1)]:
            with pytest.raises(PeerRefused):
                client.read(*args)
        assert client.read(DATASET, 2, 1, 3) == CHUNKS[2][1:4]
        assert peer.count("connections_accepted") == 1
    finally:
        client.close()


def test_blocking_client_fails_within_the_timeout_on_a_silent_or_dead_peer(peer):
    client = peer.client(timeout=0.5)
    patient = peer.client(timeout=30.0)  # for the dead peer: a timeout to notice
    try:
        assert client.read(DATASET, 0, 0, 10) == CHUNKS[0][:10]
        # Silent: the server's loop waits at the gate (up to 10 s), the reply does not come.
        stuck = peer.provider.gate = threading.Event()
        started = time.monotonic()
        with pytest.raises(PeerUnavailable, match=r"no answer within 0\.5 s"):
            client.read(DATASET, 0, 0, 10)
        assert time.monotonic() - started < 5.0  # the 0.5 s timeout, not the stall
        peer.provider.gate = None
        stuck.set()
        assert client.read(DATASET, 0, 10, 10) == CHUNKS[0][10:20]  # on a new connection
        assert patient.read(DATASET, 0, 20, 10) == CHUNKS[0][20:30]
        assert peer.count("connections_accepted") == 3
        peer.server.stop()  # dead: the server is gone
        started = time.monotonic()
        with pytest.raises(PeerUnavailable, match="closed by the peer"):
            patient.read(DATASET, 0, 0, 10)  # on the connection the server closed
        with pytest.raises(PeerUnavailable, match="cannot connect"):
            patient.read(DATASET, 0, 0, 10)
        assert time.monotonic() - started < 10.0  # neither waits for the 30 s timeout
    finally:
        client.close()
        patient.close()


async def test_blocking_client_gives_up_on_a_peer_that_trickles_its_reply(nursery):
    """The timeout bounds the whole read: a reply arriving a byte at a time (a stalled or
    hostile peer) must not hold a worker's FUSE request for minutes."""
    async def trickling_server(stream):
        decoder = protocol.FrameDecoder()
        await fake_handshake(stream, decoder)
        (read,) = decoder.feed(await stream.receive_some())
        frame = protocol.encode(protocol.data(read["id"], bytes(read["len"])))
        for i in range(len(frame)):
            await stream.send_all(frame[i:i + 1])
            await trio.sleep(0.1)

    port = await serve_fake(nursery, trickling_server)
    client = BlockingPeerClient(SECRET, "worker", "127.0.0.1", port, timeout=0.6)
    start = trio.current_time()
    with pytest.raises(PeerUnavailable, match=r"within 0\.6 s"):
        await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 1000)
    assert trio.current_time() - start < 5.0  # the whole frame would take over 100 s
    client.close()


async def test_blocking_client_late_prefix_does_not_buy_the_body_a_new_timeout(nursery):
    """A frame's length prefix that comes late leaves the body only what is left of
    the read's timeout, not a whole new one (a slow peer held reads for 2x)."""
    async def late_server(stream):
        decoder = protocol.FrameDecoder()
        await fake_handshake(stream, decoder)
        (read,) = decoder.feed(await stream.receive_some())
        frame = protocol.encode(protocol.data(read["id"], bytes(read["len"])))
        await trio.sleep(2.5)
        await stream.send_all(frame[:4])  # the prefix, within the 3 s timeout...
        await trio.sleep(2.5)
        # ...the body after it has run out, but within a new 3 s from the prefix: a
        # client that gave the body a whole new timeout gets it and returns the bytes.
        await stream.send_all(frame[4:])
        await trio.sleep_forever()

    port = await serve_fake(nursery, late_server)
    client = BlockingPeerClient(SECRET, "worker", "127.0.0.1", port, timeout=3.0)
    start = trio.current_time()
    with pytest.raises(PeerUnavailable, match=r"within 3 s"):
        await trio.to_thread.run_sync(client.read, DATASET, 0, 0, 1000)
    assert trio.current_time() - start < 5.0  # before the body was even sent
    client.close()

"""PeerLoopServer (the daemon's peer server) on loopback, with real sockets.

Good clients (BlockingPeerClient, the daemon's) read exact ranges; hostile ones
(no secret, wrong secret, garbage, oversized frames, a wrong version,
out-of-range reads) get 0 data bytes and the server keeps serving good clients
after each.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pagecache import drop_pages, missing_pages, require

from dlfs.store.format import checksum
from dlfsd.base.throttle import TokenBucket
from dlfsd.pool import protocol
from dlfsd.pool.peer import PeerMiss, PeerRefused, PeerUnavailable
from dlfsd.pool.peerserver import PeerLoopServer, serve_threads
from dlfsd.pool.peersync import BlockingPeerClient

SECRET = b"job-secret-0123456789abcdef"
DATASET = os.urandom(16)
CHUNKS = [os.urandom(4 << 20), os.urandom(7)]
NOT_STAGED = 2
CHUNK_1_SUM = checksum(CHUNKS[1])


HEADER = 64  # bytes before a chunk's data in its staged file (like a chunk header)


class Provider:
    """Chunks in real files, like staged copies; chunk NOT_STAGED exists but is not
    staged here."""

    def __init__(self, directory) -> None:
        self.reads = 0
        self.failed_copies: list[tuple[bytes, int]] = []
        # Checking copies: what the server asks when peers report or it verifies served bytes.
        self.copy_is_bad = True  # what check_copy finds
        self.checked_copies: list[tuple[int, int, int]] = []
        self.served_ok = False  # chunk 1's extent was checked as this copy served it
        self.fds, self.paths = [], []
        for i, data in enumerate(CHUNKS):
            path = directory / f"chunk{i}"
            path.write_bytes(b"h" * HEADER + data)
            self.paths.append(path)
            self.fds.append(os.open(path, os.O_RDONLY))

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)

    def chunk_limit(self, dataset_id: bytes, chunk: int) -> int | None:
        if dataset_id != DATASET or chunk > NOT_STAGED:
            return None
        return len(CHUNKS[chunk]) if chunk < NOT_STAGED else 1000

    def will_stage(self, dataset_id, chunk):
        return True

    def staged_file(self, dataset_id, chunk):
        self.reads += 1
        if chunk == NOT_STAGED:
            return None
        return self.fds[chunk], HEADER

    def staged_copy_failed(self, dataset_id, chunk, fd):
        self.failed_copies.append((dataset_id, chunk))
        return False

    def check_copy(self, dataset_id, chunk, offset, length):
        self.checked_copies.append((chunk, offset, length))
        return self.copy_is_bad

    def serve_check(self, dataset_id, chunk, offset, length):
        """Chunk 1 (7 bytes) is one extent; its checksum is CHUNK_1_SUM, until served once."""
        if chunk != 1 or (offset, length) != (0, len(CHUNKS[1])) or self.served_ok:
            return None
        return 0, CHUNK_1_SUM, 1

    def served_checked(self, dataset_id, ext, gen):
        self.served_ok = True


@pytest.fixture(params=["1 loop", "3 loops, sendfile"])
def server(tmp_path, request):
    """Every test against the one-loop server, and against three loops (connections
    handed from the first to the others) answering cached READs with sendfile."""
    provider = Provider(tmp_path)
    several = request.param != "1 loop"
    s = PeerLoopServer(SECRET, provider, "server", handshake_timeout=1.0,
                       threads=3 if several else 1, sendfile=several)
    s.port = s.start("127.0.0.1", 0)
    yield s
    s.stop()
    provider.close()


def good_read(server) -> None:
    client = BlockingPeerClient(SECRET, "good", "127.0.0.1", server.port, timeout=2)
    try:
        assert client.read(DATASET, 0, 1000, 5000) == CHUNKS[0][1000:6000]
    finally:
        client.close()


def counter_reaches(server, name: str, value: int, timeout: float = 5.0) -> bool:
    """Wait for a counter the server bumps on its own thread after the client has gone.

    The client raises as soon as it has sent its refusal; the server thread
    that reads that refusal may run later on a busy machine.
    """
    deadline = time.monotonic() + timeout
    while server.counters()[name] != value:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def raw(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=3)
    return sock


def until_closed(sock: socket.socket) -> list[dict]:
    """Everything the server sent before closing (a reset after that counts as closed)."""
    received = bytearray()
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    sock.close()
    return protocol.FrameDecoder().feed(received)


def raw_handshake(sock: socket.socket, secret: bytes = SECRET,
                  version: int = protocol.PROTOCOL_VERSION) -> protocol.ClientHandshake:
    """Returns the client's side, whose nonces prove REPORTs on this connection."""
    decoder = protocol.FrameDecoder()
    shake = protocol.ClientHandshake(secret, "raw", version)
    sock.sendall(protocol.encode(shake.hello()))
    (challenge,) = decoder.feed(sock.recv(65536))
    sock.sendall(protocol.encode(shake.auth_for(challenge)))
    (ok,) = decoder.feed(sock.recv(65536))
    shake.finish(ok)
    return shake


def test_blocking_client_reads_exact_ranges_and_errors_keep_the_connection(server):
    client = BlockingPeerClient(SECRET, "good", "127.0.0.1", server.port)
    try:
        for chunk, offset, length in [(0, 0, 300_000), (0, (4 << 20) - 1, 1), (1, 0, 7)]:
            assert client.read(DATASET, chunk, offset, length) == \
                CHUNKS[chunk][offset:offset + length]
        with pytest.raises(PeerMiss):
            client.read(DATASET, NOT_STAGED, 0, 10)
        with pytest.raises(PeerRefused):
            client.read(DATASET, 0, (4 << 20) - 1, 2)
        with pytest.raises(PeerRefused):
            client.read(os.urandom(16), 0, 0, 1)
    finally:
        client.close()
    c = server.counters()
    assert c["connections_accepted"] == 1 and c["reads_served"] == 3
    assert c["bytes_served"] == 300_008 and c["reads_missed"] == 1 and c["reads_refused"] == 2


def evict_from_page_cache(path) -> None:
    """Drop a file's pages, or skip where the file system cannot (tests/pagecache.py).

    Residency is asked of the kernel with mincore, not with a RWF_NOWAIT read:
    overlayfs (a container's /tmp) refuses RWF_NOWAIT with EOPNOTSUPP, and a NOWAIT
    miss would start read-ahead of the very pages."""
    require(Path(path).parent, "page residency")
    drop_pages([Path(path)])
    assert missing_pages(path, HEADER + (2 << 20), HEADER + (2 << 20) + 4096), \
        "a page of the chunk stayed cached after it was dropped"


def test_uncached_bytes_are_read_by_a_disk_thread_and_replies_keep_their_order(server):
    """Pipelined on one connection: a READ that waits for the disk, then one of cached
    bytes. The second is not answered before the first, and both are exact."""
    head = CHUNKS[0][:1000]
    client = BlockingPeerClient(SECRET, "good", "127.0.0.1", server.port, timeout=5)
    try:
        assert client.read(DATASET, 0, 0, 1000) == head  # cached now
    finally:
        client.close()
    evict_from_page_cache(server.provider.paths[0])
    sock = raw(server)
    try:
        raw_handshake(sock)
        sock.sendall(protocol.encode(protocol.read(1, DATASET, 0, 2 << 20, 1 << 20))
                     + protocol.encode(protocol.read(2, DATASET, 0, 0, 1000)))
        decoder, replies = protocol.FrameDecoder(protocol.MAX_FRAME), []
        while len(replies) < 2 and (received := sock.recv(1 << 20)):
            replies += decoder.feed(received)
    finally:
        sock.close()
    assert [(m["t"], m["id"]) for m in replies] == [(protocol.DATA, 1), (protocol.DATA, 2)]
    assert replies[0]["data"] == CHUNKS[0][2 << 20 : 3 << 20]
    assert replies[1]["data"] == head
    c = server.counters()
    assert c["reads_from_disk"] >= 1 and c["reads_served"] == 3 and c["read_errors"] == 0
    good_read(server)  # and the server goes on serving


def test_clients_on_several_threads_read_at_once(server):
    """Forty reads from four threads, each with a client (and receive buffer) of its own
    (as the stager's copy threads), over four connections served at once."""
    results, errors = [], []

    def reader(first: int) -> None:
        client = BlockingPeerClient(SECRET, f"thread{first}", "127.0.0.1", server.port,
                                    timeout=10, own_buffer=True)
        try:
            for i in range(first, 40, 4):
                results.append(client.read(DATASET, 0, i * 1000, 50_000)
                               == CHUNKS[0][i * 1000:i * 1000 + 50_000])
        except Exception as error:  # surfaced below: a thread's exception is lost otherwise
            errors.append(error)
        finally:
            client.close()

    threads = [threading.Thread(target=reader, args=(first,)) for first in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and results == [True] * 40
    c = server.counters()
    assert c["reads_served"] == 40 and c["connections_accepted"] == 4


def test_wrong_secret_gets_nothing(server):
    client = BlockingPeerClient(b"another-jobs-secret-0123456789", "bad", "127.0.0.1",
                                server.port)
    with pytest.raises(PeerUnavailable):
        client.read(DATASET, 0, 0, 10)
    good_read(server)
    assert counter_reaches(server, "auth_failures", 1)
    c = server.counters()
    assert c["reads_served"] == 1 and server.provider.reads == 1


def test_read_before_authenticating_is_refused_with_no_data(server):
    sock = raw(server)
    sock.sendall(protocol.encode(protocol.read(1, DATASET, 0, 0, 100)))
    replies = until_closed(sock)
    assert all(m["t"] != protocol.DATA for m in replies)
    assert server.provider.reads == 0
    good_read(server)


@pytest.mark.parametrize("attack", ["garbage", "oversized", "version", "silent"])
def test_hostile_connections_are_closed_and_the_server_keeps_serving(server, attack):
    sock = raw(server)
    if attack == "garbage":
        sock.sendall(b"\x00\x00\x00\x05hello, this is not msgpack")
    elif attack == "oversized":
        sock.sendall((protocol.MAX_FRAME + 1).to_bytes(4, "big"))
    elif attack == "version":
        sock.sendall(protocol.encode(protocol.hello("old", protocol.new_nonce(), version=99)))
    replies = until_closed(sock)  # "silent": the handshake timeout closes it
    assert all(m["t"] in (protocol.ERR,) for m in replies)
    assert server.provider.reads == 0
    good_read(server)


def test_after_auth_a_big_frame_or_a_non_read_closes_the_connection(server):
    sock = raw(server)
    raw_handshake(sock)
    sock.sendall((protocol.MAX_CONTROL_FRAME + 1).to_bytes(4, "big") + b"x" * 100)
    assert [m["t"] for m in until_closed(sock)] == [protocol.ERR]
    sock = raw(server)
    raw_handshake(sock)
    sock.sendall(protocol.encode(protocol.ok()))
    assert [m["t"] for m in until_closed(sock)] == [protocol.ERR]
    assert server.counters()["protocol_errors"] == 2
    good_read(server)


def fuzzed_read(request_id: int, chunk: int, offset: int, length: int, known: bool) -> bytes:
    return protocol.encode(protocol.read(request_id, DATASET if known else bytes(16), chunk,
                                         offset, length))


# A READ with fields near every bound: known or unknown dataset, chunk in range, not
# staged (NOT_STAGED) or beyond, offsets and lengths at and over the chunk's end.
_reads = st.builds(
    fuzzed_read, st.integers(0, protocol.MAX_REQUEST_ID), st.integers(0, NOT_STAGED + 1),
    st.one_of(st.integers(0, 20), st.integers((4 << 20) - 20, (4 << 20) + 5),
              st.integers(0, protocol.MAX_UINT)),
    st.one_of(st.integers(0, 20), st.integers(990, 1010),
              st.integers(protocol.MAX_READ - 2, protocol.MAX_READ + 2),
              st.integers(0, protocol.MAX_UINT)),
    st.booleans())


@st.composite
def _valid_reads(draw) -> bytes:
    """A READ the server must answer with DATA."""
    chunk = draw(st.sampled_from([0, 1]))
    size = len(CHUNKS[chunk])
    length = draw(st.one_of(st.integers(1, min(size, 2000)), st.integers(1, size)))
    offset = draw(st.integers(0, size - length))
    return fuzzed_read(draw(st.integers(0, protocol.MAX_REQUEST_ID)), chunk, offset, length,
                       True)


# Raw junk, or READ frames (valid or not) mixed with junk and with other messages.
_junk = st.one_of(
    st.binary(min_size=1, max_size=300),
    st.lists(st.one_of(_valid_reads(), _reads, st.binary(min_size=1, max_size=40),
                       st.just(protocol.encode(protocol.ok()))),
             min_size=1, max_size=5).map(b"".join))


def expected_replies(junk: bytes) -> tuple[list[dict], bool]:
    """The reply to each request the junk holds, in order, up to the first message
    that ends the connection (a frame that cannot be decoded, or a message other than
    READ); and whether the junk is nothing but whole READ frames."""
    decoder = protocol.FrameDecoder(protocol.MAX_CONTROL_FRAME)
    replies = []
    for i in range(len(junk)):  # byte by byte: the messages before a bad frame
        try:
            messages = decoder.feed(junk[i:i + 1])
        except protocol.ProtocolError:
            return replies, False
        for m in messages:
            if m["t"] != protocol.READ:
                return replies, False
            limit = len(CHUNKS[m["chunk"]]) if m["ds"] == DATASET and m["chunk"] < NOT_STAGED \
                else 1000 if m["ds"] == DATASET and m["chunk"] == NOT_STAGED else None
            problem = protocol.read_bounds_problem(limit, m["off"], m["len"])
            if problem is not None:
                replies.append(protocol.fail(m["id"], problem))
            elif m["chunk"] == NOT_STAGED:
                replies.append(protocol.miss(m["id"]))
            else:
                replies.append(protocol.data(m["id"], CHUNKS[m["chunk"]][
                    m["off"]:m["off"] + m["len"]]))
    return replies, decoder.buffered == 0


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_junk)
def test_fuzzed_bytes_after_auth_never_get_data_or_kill_the_server(server, junk):
    """No DATA for junk, except the exact bytes of a valid, in-bounds READ it holds."""
    sock = raw(server)
    raw_handshake(sock)
    served_before = server.counters()["bytes_served"]
    sock.sendall(junk)
    sock.shutdown(socket.SHUT_WR)
    replies = until_closed(sock)
    expected, only_reads = expected_replies(junk)
    ended = next((i for i, m in enumerate(replies) if m["t"] == protocol.ERR), len(replies))
    answers, goodbye = replies[:ended], replies[ended:]
    # In order, and only what the junk asked for (requests decoded together with a bad
    # frame that follows them may go unanswered: the connection ends at that frame),
    # then at most one ERR and nothing after it.
    assert answers == expected[:len(answers)]
    assert [m["t"] for m in goodbye] in ([], [protocol.ERR])
    if only_reads:  # nothing bad in the junk: every request answered, no ERR
        assert replies == expected
    data = [m for m in answers if m["t"] == protocol.DATA]
    event(f"{len(data)} DATA replies; {'only whole READs' if only_reads else 'junk'}")
    assert server.counters()["bytes_served"] - served_before == sum(
        len(m["data"]) for m in data)
    if not any(m["t"] == protocol.DATA for m in expected):
        assert data == [] and server.counters()["bytes_served"] == served_before
    good_read(server)


def test_stop_closes_open_connections(server):
    client = BlockingPeerClient(SECRET, "good", "127.0.0.1", server.port, timeout=2)
    assert client.read(DATASET, 1, 0, 7) == CHUNKS[1]
    server.stop()
    with pytest.raises(PeerUnavailable):
        client.read(DATASET, 1, 0, 7)
    client.close()


def test_a_reply_that_waits_for_a_slow_reader_arrives_whole_and_unchanged(server, tmp_path):
    """A whole 4 MiB reply to a client that does not read yet cannot leave at once; what
    is still to be sent must not change when another peer's read reuses the server's read
    buffer, nor when the staged copy changes meanwhile (re-staging: the provider's
    descriptor is now another file)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: tiny window
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.port))
    try:
        raw_handshake(sock)
        sock.sendall(protocol.encode(protocol.read(1, DATASET, 0, 0, 4 << 20)))
        assert counter_reaches(server, "replies_waited", 1), "the reply never had to wait"
        # Another peer's read meanwhile: the server's read buffer now holds other bytes.
        other_client = BlockingPeerClient(SECRET, "other", "127.0.0.1", server.port, timeout=5)
        try:
            assert other_client.read(DATASET, 0, 1, (4 << 20) - 1) == CHUNKS[0][1:]
        finally:
            other_client.close()
        other = tmp_path / "restaged"
        other.write_bytes(b"X" * (HEADER + (4 << 20)))
        replaced = os.open(other, os.O_RDONLY)
        os.dup2(replaced, server.provider.fds[0])  # the provider's copy is now other bytes
        os.close(replaced)
        decoder, replies = protocol.FrameDecoder(protocol.MAX_FRAME), []
        while not replies:  # the slow reader reads at last
            received = sock.recv(1 << 20)
            assert received, "the server closed the connection before its reply"
            replies = decoder.feed(received)
        (reply,) = replies
        assert reply["t"] == protocol.DATA and reply["id"] == 1
        assert reply["data"] == CHUNKS[0]
    finally:
        sock.close()


def test_truncated_staged_copy_is_a_failure_not_short_data(server):
    os.truncate(server.provider.paths[0], HEADER + 1000)
    client = BlockingPeerClient(SECRET, "good", "127.0.0.1", server.port, timeout=2)
    try:
        assert client.read(DATASET, 0, 0, 1000) == CHUNKS[0][:1000]
        with pytest.raises(PeerMiss):  # the reader then goes to another owner or the store
            client.read(DATASET, 0, 500, 1000)
        assert client.read(DATASET, 1, 0, 7) == CHUNKS[1]  # the connection still serves
    finally:
        client.close()
    assert server.counters()["bytes_served"] == 1000 + 7  # nothing short went out
    assert server.provider.failed_copies == [(DATASET, 0)]  # told to stop using that copy


# -- reports of bad copies, --verify-served ---------------------------------------------------
def test_a_reported_range_is_checked_once_per_chunk_however_many_report_it(server):
    """The reading node's workers each report the copy they got bad bytes from: one check
    (on a disk thread); reports out of bounds are refused; none stops the serving."""
    clients = [BlockingPeerClient(SECRET, f"w{i}", "127.0.0.1", server.port, timeout=2)
               for i in range(3)]
    try:
        for client in clients:
            assert client.read(DATASET, 0, 0, 10) == CHUNKS[0][:10]
            assert client.report(protocol.BadRange(DATASET, 0, 0, 1 << 20))
        assert clients[0].report(protocol.BadRange(DATASET, 1, 0, 99))  # beyond its 7 bytes
        assert counter_reaches(server, "reports_received", 4)
        assert counter_reaches(server, "reports_confirmed", 1)
        counts = server.counters()
        assert (counts["reports_dropped"], counts["reports_refused"]) == (2, 1)
        assert server.provider.checked_copies == [(0, 0, 1 << 20)]
        assert clients[1].read(DATASET, 1, 0, 7) == CHUNKS[1]  # the connection serves on
    finally:
        for client in clients:
            client.close()
    assert server.counters()["protocol_errors"] == 0


def test_a_copy_that_checks_out_is_kept(server, caplog):
    server.provider.copy_is_bad = False
    client = BlockingPeerClient(SECRET, "w", "127.0.0.1", server.port, timeout=2)
    try:
        client.read(DATASET, 0, 0, 10)
        assert client.report(protocol.BadRange(DATASET, 0, 0, 4096))
        assert counter_reaches(server, "reports_unconfirmed", 1)
    finally:
        client.close()
    assert "checks out" in caplog.text and server.counters()["reports_confirmed"] == 0


@pytest.mark.parametrize("how", ["forged", "replayed", "version 1"])
def test_a_report_that_does_not_prove_itself_closes_the_connection(server, how):
    sock = raw(server)
    shake = raw_handshake(sock, version=1 if how == "version 1" else 2)
    bad = protocol.BadRange(DATASET, 0, 0, 4096)
    if how == "version 1":  # a version 1 connection has no REPORT: anything like it is wrong
        report = {"t": protocol.REPORT, "n": 1, "ds": DATASET, "chunk": 0, "off": 0,
                  "len": 4096, "proof": bytes(32)}
    elif how == "forged":
        report = dict(shake.report(bad), proof=bytes(32))
    else:
        report = shake.report(bad)
        sock.sendall(protocol.encode(report))
    sock.sendall(protocol.encode(report))
    replies = until_closed(sock)
    assert [(m["t"], m["code"]) for m in replies] == [(protocol.ERR, protocol.ERR_PROTOCOL)]
    assert counter_reaches(server, "protocol_errors", 1)
    if how == "replayed":  # the first one counted
        assert counter_reaches(server, "reports_confirmed", 1)
    assert len(server.provider.checked_copies) == (1 if how == "replayed" else 0)
    good_read(server)


@pytest.mark.parametrize("where", ["page cache", "disk"])
def test_verify_served_checks_an_extent_the_first_time_only(tmp_path, where):
    """Bytes in the page cache are checked in the loop, bytes read from the disk on the
    disk thread; either way a bad extent is not served and its copy is evicted.
    Counting reads from the disk needs the page cache to answer RWF_NOWAIT reads
    (overlayfs does not: every read goes to the disk thread there)."""
    require(tmp_path, "nowait read")
    provider = Provider(tmp_path)
    server = PeerLoopServer(SECRET, provider, "server", verify_served=True)
    port = server.start("127.0.0.1", 0)
    client = BlockingPeerClient(SECRET, "good", "127.0.0.1", port, timeout=2)
    try:
        for _ in range(3):
            assert client.read(DATASET, 1, 0, 7) == CHUNKS[1]
        assert client.read(DATASET, 0, 0, 100) == CHUNKS[0][:100]  # not one extent: as is
        assert server.counters()["served_checks"] == 1
        provider.served_ok = False  # a new copy: checked again, and now it is bad
        with open(provider.paths[1], "r+b") as f:
            f.seek(HEADER + 3)
            f.write(b"\xff" if CHUNKS[1][3] != 0xFF else b"\x00")
        if where == "disk":
            require(tmp_path, "page residency")
            os.sync()
            drop_pages([provider.paths[1]])
            assert missing_pages(provider.paths[1]), "the copy stayed in the page cache"
        with pytest.raises(PeerMiss):  # FAIL io-error: the reader goes elsewhere
            client.read(DATASET, 1, 0, 7)
    finally:
        client.close()
        server.stop()
        provider.close()
    counts = server.counters()
    assert (counts["served_checks"], counts["served_bad"]) == (2, 1)
    assert counts["reads_from_disk"] == (1 if where == "disk" else 0)
    assert counts["bytes_served"] == 3 * 7 + 100  # the bad bytes never left
    assert provider.failed_copies == [(DATASET, 1)]  # evict and re-stage it


def test_the_report_budget_allows_a_burst_then_its_rate():
    """What both sides limit reports with (the client per process, the server in all)."""
    bucket = TokenBucket(rate=20.0, burst=3)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    deadline = time.monotonic() + 5
    while not bucket.take():  # a token comes back within 1/20 s; bounded, not timed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not bucket.take()


def test_a_flood_of_failed_handshakes_is_logged_as_summaries(server, caplog):
    """Anyone reaching the peer port can fail handshakes as fast as they connect: the
    log gets the first failure of each cause, then one summary per cause (10 s)."""
    caplog.set_level("WARNING", logger="dlfsd.pool.peer")
    attempts = 30
    for _ in range(attempts):
        client = BlockingPeerClient(b"another-jobs-secret-0123456789", "bad", "127.0.0.1",
                                    server.port)
        with pytest.raises(PeerUnavailable):
            client.read(DATASET, 0, 0, 10)
        client.close()
        sock = raw(server)
        sock.sendall(b"\x00\x00\x00\x05hello, this is not msgpack")
        until_closed(sock)
    assert counter_reaches(server, "auth_failures", attempts)
    assert counter_reaches(server, "protocol_errors", attempts)
    good_read(server)  # the flood did not stop the server

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "dlfsd.pool.peer"]

    assert sum("different job secrets" in line for line in lines()) == 1, lines()
    assert sum("protocol error" in line for line in lines()) == 1, lines()
    deadline = time.monotonic() + 15
    while sum("failed peer handshakes from" in line for line in lines()) < 2:
        assert time.monotonic() < deadline, lines()
        time.sleep(0.1)
    summaries = sorted(line for line in lines() if "failed peer handshakes from" in line)
    assert summaries[0].startswith(f"peer server: {attempts - 1} failed peer handshakes "
                                   "from 1 addresses in the last 1"), summaries
    assert summaries[0].endswith("s: our proof rejected (different job secrets) "
                                 "(e.g. 127.0.0.1)")
    assert "protocol error before the handshake" in summaries[1]
    assert len(lines()) == 4, lines()  # nothing else: not a line per attempt


# -- several loops ------------------------------------------------------------------------------
def test_a_busy_loop_does_not_hold_up_the_other_loops_peers(tmp_path):
    """Connections are handed to the loops in turn: while one loop is stuck in a slow
    provider call (a copy being opened on a busy disk), a peer on another loop is served."""
    gate = threading.Event()

    class SlowChunkOne(Provider):
        def staged_file(self, dataset_id, chunk):
            if chunk == 1:
                gate.wait(10)
            return super().staged_file(dataset_id, chunk)

    provider = SlowChunkOne(tmp_path)
    server = PeerLoopServer(SECRET, provider, "server", threads=2)
    port = server.start("127.0.0.1", 0)
    stuck = BlockingPeerClient(SECRET, "stuck", "127.0.0.1", port, timeout=5)
    other = BlockingPeerClient(SECRET, "other", "127.0.0.1", port, timeout=5)
    try:
        assert stuck.read(DATASET, 0, 0, 10) == CHUNKS[0][:10]  # the first loop's peer
        got = []
        waiting = threading.Thread(target=lambda: got.append(stuck.read(DATASET, 1, 0, 7)))
        waiting.start()
        time.sleep(0.2)  # the first loop is in staged_file now
        started = time.monotonic()
        assert other.read(DATASET, 0, 4096, 100_000) == CHUNKS[0][4096:104_096]
        assert time.monotonic() - started < 2.0 and not got
        gate.set()
        waiting.join(5)
        assert got == [CHUNKS[1]]
        assert server.counters()["connections_open"] == 2
    finally:
        gate.set()
        stuck.close()
        other.close()
        server.stop()
        provider.close()


def test_serve_threads_one_unless_asked_and_auto_follows_the_cores(monkeypatch):
    """One loop by default; DLFS_PEER_LOOPS=N asks for N (at most 8); `auto` sizes them
    as the FUSE workers are: by the CPUs this process may run on, 4 to 8."""
    monkeypatch.delenv("DLFS_PEER_LOOPS", raising=False)
    assert serve_threads() == 1
    monkeypatch.setenv("DLFS_PEER_LOOPS", "3")
    assert serve_threads() == 3
    monkeypatch.setenv("DLFS_PEER_LOOPS", "auto")
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert serve_threads() == 4
    finally:
        os.sched_setaffinity(0, before)
    assert serve_threads() == min(max(len(before), 4), 8)


def test_every_loop_serves_when_peers_connect_while_the_server_starts(tmp_path):
    """Peers connect the moment the port listens (a job's daemons come up one by one
    and retry). The first loop used to accept then, before the next loop had its
    wake-up socket: it died of handing the connection over, and every connection
    handed to it afterwards went unanswered (the 16-daemon test's handshakes > 2 s)."""
    provider = Provider(tmp_path)
    try:
        for _ in range(5):
            port = free_port()
            stop = threading.Event()
            knocker = threading.Thread(target=knock, args=(port, stop))
            knocker.start()
            server = PeerLoopServer(SECRET, provider, "server", threads=3)
            try:
                time.sleep(0.01)  # knocking already
                server.start("127.0.0.1", port)
                time.sleep(0.05)
                stop.set()
                knocker.join()
                for _ in range(6):  # handed to each loop in turn, twice
                    client = BlockingPeerClient(SECRET, "good", "127.0.0.1", port, timeout=2)
                    try:
                        assert client.read(DATASET, 0, 0, 10) == CHUNKS[0][:10]
                    finally:
                        client.close()
            finally:
                stop.set()
                knocker.join()
                server.stop()
    finally:
        provider.close()


def knock(port: int, stop: threading.Event) -> None:
    """Connect and hang up, again and again, until `stop`."""
    while not stop.is_set():
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

"""BlockingPeerClient.read_many: several READs in flight on one connection.

Against the daemon's PeerLoopServer on loopback (exact bytes, a MISS or a refusal in
the middle, the batch cap) and fake servers that show what the wire carried: the
READs of a batch arrive before any reply leaves, a peer that dies or stalls in the
middle of a batch fails it within the timeout and what came before stays good.
"""

from __future__ import annotations

import socket

import pytest
import trio
from peerfakes import DATASET, SECRET
from test_peer import CHUNKS, FAILING, NOT_STAGED, fake_handshake, peer, serve_fake, start_peer

from dlfsd.pool import protocol
from dlfsd.pool.peer import PeerMiss, PeerRefused, PeerUnavailable
from dlfsd.pool.peersync import BATCH_BYTES, BATCH_READS, BlockingPeerClient

__all__ = ["peer", "start_peer"]  # fixtures used here


def collect(client: BlockingPeerClient, reads: list) -> dict[int, object]:
    """read_many's replies by index: bytes (copied out of the receive buffer) or the error."""
    got: dict[int, object] = {}

    def on_reply(index: int, result) -> None:
        assert index not in got
        got[index] = result if isinstance(result, Exception) else bytes(result)

    client.read_many(reads, on_reply)
    return got


def test_a_batch_returns_exactly_the_bytes_of_each_range(peer):
    reads = [(DATASET, 0, 0, 100_000), (DATASET, 2, 0, 7), (DATASET, 0, 99_999, 1),
             (DATASET, 1, 12_345, 1 << 20), (DATASET, 0, 500, 5)]
    client = peer.client()
    try:
        got = collect(client, reads)
        assert got == {i: CHUNKS[c][o:o + n] for i, (_, c, o, n) in enumerate(reads)}
        assert collect(client, reads[:2]) == {0: CHUNKS[0][:100_000], 1: CHUNKS[2]}
        assert client.read(DATASET, 2, 1, 3) == CHUNKS[2][1:4]  # plain reads after it
        assert peer.count("connections_accepted") == 1
    finally:
        client.close()


def test_a_miss_or_refusal_in_the_middle_of_a_batch_costs_only_that_read(peer):
    reads = [(DATASET, 0, 0, 1000), (DATASET, NOT_STAGED, 0, 10), (DATASET, 0, 1000, 1000),
             (DATASET, FAILING, 0, 10), (DATASET, 0, 99_990, 11), (DATASET, 2, 0, 7)]
    client = peer.client()
    try:
        got = collect(client, reads)
        assert got[0] == CHUNKS[0][:1000] and got[2] == CHUNKS[0][1000:2000]
        assert got[5] == CHUNKS[2]
        assert isinstance(got[1], PeerMiss) and got[1].code is None
        assert isinstance(got[3], PeerMiss) and got[3].code == protocol.FAIL_IO
        assert isinstance(got[4], PeerRefused) and got[4].code == protocol.FAIL_OUT_OF_RANGE
        assert client.read(DATASET, 0, 5, 5) == CHUNKS[0][5:10]
        assert peer.count("connections_accepted") == 1
    finally:
        client.close()


def test_a_batch_over_the_cap_is_split_and_still_exact(peer):
    many = [(DATASET, 0, i * 100, 100) for i in range(BATCH_READS + 9)]
    large = [(DATASET, 1, i * 100_000, 1 << 19) for i in range(BATCH_BYTES // (1 << 19) + 2)]
    client = peer.client()
    try:
        for reads in (many, large, [(DATASET, 1, 0, protocol.MAX_READ), *many[:3]]):
            got = collect(client, reads)
            assert got == {i: CHUNKS[c][o:o + n] for i, (_, c, o, n) in enumerate(reads)}
        assert peer.count("connections_accepted") == 1
    finally:
        client.close()


async def pipelining_server(stream, bursts: list[int], die_after: int | None = None,
                            stall_after: int | None = None) -> None:
    """Answers READs with the bytes of CHUNKS[1], but only once no more requests come
    for 50 ms: `bursts` records how many were waiting each time (a client that waits
    for each reply before sending the next READ gets its replies 50 ms late, one by
    one). After `die_after` replies it closes the connection; after `stall_after` it
    goes silent."""
    decoder = protocol.FrameDecoder()
    await fake_handshake(stream, decoder)
    waiting: list[dict] = []
    sent = 0
    while True:
        with trio.move_on_after(0.05) as quiet:
            data = await stream.receive_some()
            if not data:
                return
            waiting.extend(decoder.feed(data))
        if not quiet.cancelled_caught or not waiting:
            continue
        bursts.append(len(waiting))
        for read in waiting:
            if sent == die_after:
                await stream.aclose()
                return
            if sent == stall_after:
                await trio.sleep_forever()
            await stream.send_all(protocol.encode(protocol.data(
                read["id"], CHUNKS[1][read["off"]:read["off"] + read["len"]])))
            sent += 1
        waiting.clear()


async def test_the_reads_of_a_batch_are_on_the_wire_together_up_to_the_cap(nursery):
    bursts: list[int] = []
    port = await serve_fake(nursery, lambda stream: pipelining_server(stream, bursts))
    client = BlockingPeerClient(SECRET, "reader", "127.0.0.1", port, timeout=5.0)
    many = [(DATASET, 1, i * 10, 10) for i in range(BATCH_READS + 5)]
    large = [(DATASET, 1, i * 100_000, 1 << 20) for i in range(BATCH_BYTES // (1 << 20) + 2)]
    for reads in (many, large):
        got = await trio.to_thread.run_sync(collect, client, reads)
        assert got == {i: CHUNKS[1][o:o + n] for i, (_, _, o, n) in enumerate(reads)}
    # rounds of the cap, then the rest: BATCH_READS requests, BATCH_BYTES asked
    assert bursts == [BATCH_READS, 5, BATCH_BYTES >> 20, 2]
    client.close()


@pytest.mark.parametrize("how", ["dies", "stalls"])
async def test_a_peer_lost_in_the_middle_of_a_batch_fails_it_in_time(nursery, how):
    """The replies before the loss are handed out and stay good; the batch fails at
    once (a closed connection) or within the timeout (a silent peer), never hangs; the
    next read opens a new connection."""
    bursts: list[int] = []
    connections: list[int] = []

    async def server(stream):
        connections.append(1)
        if len(connections) == 1:
            await pipelining_server(stream, bursts, **{f"{how[:-1]}_after": 3})
        else:
            await pipelining_server(stream, bursts)

    port = await serve_fake(nursery, server)
    client = BlockingPeerClient(SECRET, "reader", "127.0.0.1", port, timeout=1.0)
    got: dict[int, bytes] = {}

    def on_reply(index, data) -> None:
        got[index] = bytes(data)

    reads = [(DATASET, 1, i * 10, 10) for i in range(8)]
    start = trio.current_time()
    with pytest.raises(PeerUnavailable):
        await trio.to_thread.run_sync(client.read_many, reads, on_reply)
    took = trio.current_time() - start
    assert took < (0.9 if how == "dies" else 3.0)  # at once / the 1 s timeout
    assert got == {i: CHUNKS[1][i * 10:i * 10 + 10] for i in range(3)}
    assert await trio.to_thread.run_sync(client.read, DATASET, 1, 0, 10) == CHUNKS[1][:10]
    assert len(connections) == 2
    client.close()


async def test_a_batch_on_a_connection_closed_while_idle_goes_again_on_a_new_one(nursery):
    """As for one read: the server closed the kept connection (idle timeout, restart)
    before the batch came; the whole batch is sent again, once, on a new connection."""
    bursts: list[int] = []
    connections: list[int] = []

    async def server(stream):
        connections.append(1)
        if len(connections) > 1:
            await pipelining_server(stream, bursts)
            return
        decoder = protocol.FrameDecoder()  # one read answered, then closed
        await fake_handshake(stream, decoder)
        (read,) = decoder.feed(await stream.receive_some())
        await stream.send_all(protocol.encode(protocol.data(read["id"], CHUNKS[1][:10])))
        await stream.aclose()

    port = await serve_fake(nursery, server)
    client = BlockingPeerClient(SECRET, "reader", "127.0.0.1", port, timeout=5.0)
    assert await trio.to_thread.run_sync(client.read, DATASET, 1, 0, 10) == CHUNKS[1][:10]
    await trio.sleep(0.3)  # the server has closed the connection the client keeps
    reads = [(DATASET, 1, i * 10, 10) for i in range(4)]
    got = await trio.to_thread.run_sync(collect, client, reads)
    assert got == {i: CHUNKS[1][i * 10:i * 10 + 10] for i in range(4)}
    assert len(connections) == 2 and bursts[-1] == 4
    client.close()


def test_a_rounds_requests_fit_the_smallest_socket_buffers_unread():
    """Why a batch cannot deadlock: the READs of a full round go into the kernel at
    once even with the smallest send and receive buffers TCP allows and a server that
    reads nothing (it reads nothing while one of its replies waits to go out)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's minimum
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
    client.connect(listener.getsockname())
    server, _ = listener.accept()
    try:
        client.setblocking(False)
        round_ = b"".join(protocol.read_frame(i, DATASET, 1 << 40, 1 << 40, protocol.MAX_READ)
                          for i in range(BATCH_READS))
        assert client.send(round_) == len(round_)
    finally:
        for s in (client, server, listener):
            s.close()

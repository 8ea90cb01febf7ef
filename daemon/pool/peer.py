"""The trio peer client of the chunk pool, and the errors every peer read raises.

A daemon reads byte ranges of the chunks other daemons have staged on their
local NVMe. The server side is dlfsd.pool.peerserver (PeerLoopServer); the daemon's
worker processes use the blocking client (dlfsd.pool.peersync). This trio client
served the single-process mounts (`--workers 1`), which are gone: no part of the
daemon uses it now (the errors below are everyone's). The wire format and every
validity rule live in dlfsd.pool.protocol (docs/PROTOCOL.md); this module adds
sockets, timeouts and concurrency:

* Nothing is requested before the server proved it holds the job secret.
* Requests are pipelined: each READ is tagged with an id and the replies are
  matched to them; a late reply to an abandoned request is dropped, never
  taken for a newer one.
* Every call has a deadline, and every way a peer can go wrong (refused,
  silent, wrong secret, dead mid-request, talking nonsense) surfaces as
  PeerUnavailable, so the caller can mark the peer down and read elsewhere.

Nothing here imports pyfuse3 or touches a path.
"""

from __future__ import annotations

import collections
import logging

import trio

from dlfs.errors import DlfsError
from dlfsd.pool import protocol
from dlfsd.pool.protocol import Message, ProtocolError

log = logging.getLogger(__name__)

_RECEIVE_SIZE = 256 << 10
# A client gives up on a connection whose peer left this many timed-out requests
# unanswered: their ids stay reserved (a late reply must never be mistaken for
# the answer to a newer request), so they must not pile up without bound.
_MAX_ABANDONED = 64


class PeerError(DlfsError):
    """A read from a peer daemon did not return the bytes."""


class PeerUnavailable(PeerError):
    """The peer cannot be used now (down, silent, wrong secret, broken connection).

    The caller should mark the peer down and read from a replica or the store.
    """


class PeerMiss(PeerError):
    """The peer does not have the chunk staged (or could not read its own copy)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class PeerRefused(PeerError):
    """The peer refused the range as out of bounds: a caller bug or another dataset version."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class _FramedStream:
    """A trio stream speaking frames: receive() one message, send() one message.

    Sends are serialized by a lock (trio streams allow one send at a time). A
    send interrupted half way would leave a partial frame on the wire, so the
    stream marks itself broken and refuses further sends.
    """

    def __init__(self, stream: trio.abc.Stream, max_frame: int) -> None:
        self.stream = stream
        self.broken = False
        self._decoder = protocol.FrameDecoder(max_frame)
        self._received: collections.deque[Message] = collections.deque()
        self._send_lock = trio.Lock()

    async def receive(self) -> Message | None:
        """The next message; None at a clean end of stream."""
        while not self._received:
            chunk = await self.stream.receive_some(_RECEIVE_SIZE)
            if not chunk:
                if self._decoder.buffered:
                    raise ProtocolError("connection closed in the middle of a frame")
                return None
            self._received.extend(self._decoder.feed(chunk))
        return self._received.popleft()

    async def send(self, msg: Message) -> None:
        frame = protocol.encode(msg)
        async with self._send_lock:
            if self.broken:
                raise trio.ClosedResourceError("an earlier send was interrupted")
            try:
                await self.stream.send_all(frame)
            except BaseException:
                self.broken = True
                raise


# -- client ------------------------------------------------------------------

class _Waiter:
    """One pending READ: the receive task fills in the reply or the error."""

    __slots__ = ("abandoned", "done", "error", "length", "reply")

    def __init__(self, length: int) -> None:
        self.length = length
        self.done = trio.Event()
        self.reply: Message | None = None
        self.error: PeerError | None = None
        self.abandoned = False


class _Connection:
    """One authenticated connection: pipelined requests, one task routing replies."""

    def __init__(self, framed: _FramedStream, address: str,
                 session: protocol.ClientHandshake) -> None:
        self.framed = framed
        self.address = address
        self.session = session  # its handshake: REPORTs on it are proven with its nonces
        self.closed = False
        self.finished = trio.Event()  # the receive task has closed the stream
        self._waiters: dict[int, _Waiter] = {}
        self._next_id = 0
        self._abandoned = 0
        self._cancel_scope = trio.CancelScope()

    async def request(self, dataset_id: bytes, chunk: int, offset: int, length: int) -> bytes:
        if self.closed:
            raise PeerUnavailable(f"connection to peer {self.address} is closed")
        request_id = self._allocate_id()
        waiter = _Waiter(length)
        self._waiters[request_id] = waiter
        sent = False
        try:
            await self.framed.send(protocol.read(request_id, dataset_id, chunk, offset, length))
            sent = True
            await waiter.done.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            self._waiters.pop(request_id, None)
            lost = PeerUnavailable(f"connection to peer {self.address} lost: {error}")
            self.fail(lost)
            raise waiter.error or lost from None
        except BaseException:
            self._abandon(request_id, waiter, sent)
            raise
        return self._result(waiter, dataset_id, chunk, offset, length)

    def _allocate_id(self) -> int:
        # Ids of requests still awaiting a reply (even abandoned ones) are skipped.
        while self._next_id in self._waiters:
            self._next_id = (self._next_id + 1) & protocol.MAX_REQUEST_ID
        request_id = self._next_id
        self._next_id = (request_id + 1) & protocol.MAX_REQUEST_ID
        return request_id

    def _abandon(self, request_id: int, waiter: _Waiter, sent: bool) -> None:
        """The caller gave up (timeout, cancellation); a late reply will be dropped."""
        if self.framed.broken:  # cancelled half way through sending the request
            self._waiters.pop(request_id, None)
            self.fail(PeerUnavailable(f"a send to peer {self.address} was interrupted"))
            return
        if not sent or waiter.done.is_set() or self.closed:  # no reply can come
            self._waiters.pop(request_id, None)
            return
        waiter.abandoned = True
        self._abandoned += 1
        if self._abandoned > _MAX_ABANDONED:
            self.fail(PeerUnavailable(f"peer {self.address} left {self._abandoned} requests "
                                      "unanswered"))

    def _result(self, waiter: _Waiter, dataset_id: bytes, chunk: int, offset: int,
                length: int) -> bytes:
        if waiter.error is not None:
            raise waiter.error
        return reply_bytes(waiter.reply, f"chunk {chunk} of dataset {dataset_id.hex()} on "
                           f"peer {self.address}", offset, length)

    async def receive_replies(self) -> None:
        """The one reader of this connection; runs as a system task until the connection ends."""
        error = PeerUnavailable(f"connection to peer {self.address} closed")
        try:
            with self._cancel_scope:
                while True:
                    msg = await self.framed.receive()
                    if msg is None:
                        raise PeerUnavailable(f"peer {self.address} closed the connection")
                    self._route(msg)
        except PeerUnavailable as lost:
            error = lost
        except ProtocolError as bad:
            log.warning("peer %s: protocol error: %s; dropping the connection", self.address, bad)
            error = PeerUnavailable(f"peer {self.address} broke the protocol: {bad}")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as lost:
            error = PeerUnavailable(f"connection to peer {self.address} lost: {lost}")
        except Exception as bug:  # a system task must not raise: it would end the run
            log.exception("peer %s: unexpected error in the receive task", self.address)
            error = PeerUnavailable(f"connection to peer {self.address} failed: {bug!r}")
        finally:
            # Also on cancellation (aclose, or the end of the trio run).
            self.fail(error)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.framed.stream)
            self.finished.set()

    def _route(self, msg: Message) -> None:
        kind = msg["t"]
        if kind == protocol.ERR:
            raise PeerUnavailable(f"peer {self.address} closed the connection: "
                                  f"{msg['code']}: {msg['msg']}")
        if kind not in (protocol.DATA, protocol.MISS, protocol.FAIL):
            raise ProtocolError(f"unexpected {kind} message")
        # Check before popping: on a ProtocolError, fail() must still find this waiter.
        waiter = self._waiters.get(msg["id"])
        if waiter is None:
            raise ProtocolError(f"reply for request id {msg['id']}, which is not pending")
        if kind == protocol.DATA and len(msg["data"]) != waiter.length:
            raise ProtocolError(f"{len(msg['data'])} bytes of data for a read of {waiter.length}")
        del self._waiters[msg["id"]]
        if waiter.abandoned:
            self._abandoned -= 1
            return
        waiter.reply = msg
        waiter.done.set()

    def fail(self, error: PeerUnavailable) -> None:
        """Fail every pending request and stop the receive task (which closes the stream)."""
        if self.closed:
            return
        self.closed = True
        for waiter in self._waiters.values():
            waiter.error = error
            waiter.done.set()
        self._waiters.clear()
        self._cancel_scope.cancel()


class PeerClient:
    """Reads byte ranges from one peer daemon over a few pooled, pipelined connections.

    Safe to use from many tasks of one trio run at once. Connections open
    lazily on the first reads and reopen after a failure, so construction
    creates no trio objects: an instance belongs to the trio run that first
    uses it, and one used from a new run (a forked worker with its own
    trio.run) forgets the old run's connections and opens its own.
    """

    def __init__(self, secret: bytes, node_name: str, host: str, port: int, *,
                 timeout: float = 5.0, connections: int = 2) -> None:
        if connections < 1:
            raise ValueError("connections must be at least 1")
        self._secret = protocol.check_secret(secret)
        self.node_name = node_name
        self.host = host
        self.port = port
        self.timeout = timeout
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._slots: list[_Connection | None] = [None] * connections
        self._slot_locks: list[trio.Lock] = []
        self._next_slot = 0
        self._run_token: trio.lowlevel.TrioToken | None = None
        self._closed = False
        self._version = protocol.PROTOCOL_VERSION  # lowered for a server that refused it

    async def read(self, dataset_id: bytes, chunk: int, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of the chunk's data (exactly, or an exception).

        Raises PeerUnavailable (peer unusable: try elsewhere and mark it down),
        PeerMiss (not staged there), PeerRefused (range out of bounds), each
        within `timeout` seconds.
        """
        _check_read_args(dataset_id, chunk, offset, length)
        if self._closed:
            raise PeerUnavailable(f"client for peer {self.address} is closed")
        try:
            with trio.fail_after(self.timeout):
                connection = await self._connection()
                return await connection.request(dataset_id, chunk, offset, length)
        except trio.TooSlowError:
            raise PeerUnavailable(f"peer {self.address} did not answer within "
                                  f"{self.timeout:g} s") from None

    async def report(self, bad: protocol.BadRange) -> bool:
        """Tell the peer that its bytes of `bad` failed their checksum here (best effort,
        no reply, within `timeout`). False if it could not be told (a version 1 peer, a
        connection that failed)."""
        if self._closed:
            return False
        try:
            with trio.fail_after(self.timeout):
                connection = await self._connection()
                if not connection.session.reports:
                    return False
                await connection.framed.send(connection.session.report(bad))
        except (PeerError, trio.TooSlowError, trio.BrokenResourceError,
                trio.ClosedResourceError, OSError):
            return False
        return True

    async def aclose(self) -> None:
        """Close every connection; pending and later reads raise PeerUnavailable."""
        self._closed = True
        if self._run_token is not trio.lowlevel.current_trio_token():
            return  # connections of another run are not ours to touch
        closing = [c for c in self._slots if c is not None]
        self._slots = [None] * len(self._slots)
        for connection in closing:
            connection.fail(PeerUnavailable(f"client for peer {self.address} is closed"))
        for connection in closing:
            await connection.finished.wait()

    async def _connection(self) -> _Connection:
        self._bind_to_current_run()
        index = self._next_slot
        self._next_slot = (index + 1) % len(self._slots)
        connection = self._slots[index]
        if connection is not None and not connection.closed:
            return connection
        # One connect per slot at a time: tasks arriving meanwhile wait for it
        # (under their own deadline) instead of opening extra connections.
        async with self._slot_locks[index]:
            connection = self._slots[index]
            if connection is None or connection.closed:
                connection = await self._connect()
                self._slots[index] = connection
            return connection

    def _bind_to_current_run(self) -> None:
        token = trio.lowlevel.current_trio_token()
        if token is not self._run_token:
            self._run_token = token
            self._slots = [None] * len(self._slots)
            self._slot_locks = [trio.Lock() for _ in self._slots]

    async def _connect(self) -> _Connection:
        """A new authenticated connection, in the oldest version we speak if the server
        refuses ours (a version 1 daemon): that version is kept for this peer."""
        try:
            return await self._connect_speaking(self._version)
        except protocol.VersionRefused as refused:
            if self._version == protocol.MIN_PROTOCOL_VERSION:
                raise PeerUnavailable(f"peer {self.address} {refused}") from None
        self._version = protocol.MIN_PROTOCOL_VERSION
        return await self._connect_speaking(self._version)

    async def _connect_speaking(self, version: int) -> _Connection:
        try:
            stream = await trio.open_tcp_stream(self.host, self.port)
        except OSError as error:
            raise PeerUnavailable(f"cannot connect to peer {self.address}: "
                                  f"{error.strerror or error}") from None
        framed = _FramedStream(stream, protocol.MAX_FRAME)
        try:
            session = await self._handshake(framed, version)
        except ProtocolError as error:
            await trio.aclose_forcefully(stream)
            raise PeerUnavailable(f"peer {self.address} broke the protocol: {error}") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            await trio.aclose_forcefully(stream)
            raise PeerUnavailable(f"connection to peer {self.address} lost during the "
                                  f"handshake: {error}") from None
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        connection = _Connection(framed, self.address, session)
        trio.lowlevel.spawn_system_task(connection.receive_replies,
                                        name=f"dlfsd.pool.peer receive {self.address}")
        return connection

    async def _handshake(self, framed: _FramedStream,
                         version: int) -> protocol.ClientHandshake:
        """Prove we hold the secret and check that the server does too
        (protocol.ClientHandshake decides; this only moves the messages)."""
        shake = protocol.ClientHandshake(self._secret, self.node_name, version)
        await framed.send(shake.hello())
        try:
            await framed.send(shake.auth_for(await framed.receive()))
            shake.finish(await framed.receive())
            return shake
        except protocol.VersionRefused:
            raise
        except protocol.HandshakeFailed as failed:
            if failed.reply is not None:
                await framed.send(failed.reply)
            raise PeerUnavailable(f"peer {self.address} {failed}") from None


def reply_bytes(reply: Message, where: str, offset: int, length: int) -> bytes:
    """The payload of a DATA reply to a READ; PeerMiss or PeerRefused for MISS or FAIL.

    Shared by both clients; each checks beforehand that the reply answers its request.
    """
    if reply["t"] == protocol.DATA:
        return reply["data"]
    if reply["t"] == protocol.MISS:
        raise PeerMiss(f"{where} is not staged")
    code = reply["code"]
    if code in protocol.BOUNDS_FAIL_CODES:
        raise PeerRefused(f"{where}: read of {length} bytes at {offset} refused ({code})", code)
    raise PeerMiss(f"{where}: the peer could not read it ({code})", code)


def _check_read_args(dataset_id: bytes, chunk: int, offset: int, length: int) -> None:
    """Arguments the wire cannot carry are a caller bug, not a peer problem."""
    if not isinstance(dataset_id, bytes) or len(dataset_id) != protocol.DATASET_ID_SIZE:
        raise ValueError(f"dataset_id must be {protocol.DATASET_ID_SIZE} bytes")
    for name, value in (("chunk", chunk), ("offset", offset), ("length", length)):
        if type(value) is not int or not 0 <= value <= protocol.MAX_UINT:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")

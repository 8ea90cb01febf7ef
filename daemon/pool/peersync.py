"""BlockingPeerClient: the peer protocol over one plain blocking socket.

The daemon's one peer client. Its users serve one FUSE request at a time (the
worker processes) or copy on threads of their own (dlfsd.pool.replicate, on
the stager's copy threads), and do their disk reads blocking and inline: a
blocking round trip costs a few system calls and no event loop. Wire
protocol: docs/PROTOCOL.md (dlfsd.pool.protocol decides the handshake; this
only moves its messages); errors: dlfsd.pool.peer. One request in flight per
connection, except in `read_many` (below).

A DATA reply is received whole into one buffer and its payload handed out as
a view of that buffer when the frame starts with exactly the head expected
for this request; anything else is decoded the general way. The first
receive asks for the whole expected frame, length prefix included, without
MSG_WAITALL: a reply that has all come (the usual case: the reading worker
is woken once the first segment is there, and runs after the rest came) is
then one system call, not one for the prefix and one for the body; the rest
of a reply that has not come is received with MSG_WAITALL (one call, not one
per arriving segment). The request itself is protocol.read_frame, packed in
one call.

The receive buffer (4 MiB, the largest frame) is one per process, shared by
all its clients: a worker serves one request at a time, and a worker talking
to N peers must not hold N of them. So the view is valid only until the next
read on ANY client of the process; the callers (ChunkPool.fetch,
PeerShare.read) use or copy it first. Not for use from several threads at
once.

A connection kept between reads may have been closed by the server meanwhile
(idle for its idle_timeout, or the peer daemon restarted): a read on it that
fails before any byte of the reply came is sent again, once, on a new
connection, within the same timeout; a peer that is really gone then fails to
connect.

`read_many` pipelines: the READs of a batch leave in one send and their replies
are taken in turn, each handed to the caller's callback while its bytes are in
the receive buffer (the next reply overwrites them): a callback keeps the one
buffer and the one copy a read costs today, where buffers per reply would cost
a batch's bytes of memory and a copy more, or a receive straight into them
could not check a reply's head first. Why pipeline: each READ
alone costs both sides a wake-up (the server's loop, the reader's recv); a batch
of N costs about one. A batch is cut into rounds of at most BATCH_READS requests
and BATCH_BYTES bytes asked (a single larger read goes alone), each round with
the deadline of one read: its replies are no more bytes than one read of
MAX_READ. Its requests (82 bytes each, BATCH_READS of them: 1.3 KiB) go into
the kernel at once even with the smallest send and receive buffers TCP allows
(2.3 KiB get in then; tests/test_peer_pipeline.py), so the one send never waits
for the server, which stops reading a connection while a reply of it waits to
go out: the client always gets to reading the replies, no deadlock whatever the
socket buffers.

A client speaks protocol version 2 first; a server that refuses it (version
1) is asked again, on a new connection, in version 1, which the client then
keeps speaking to it: nothing is lost but REPORT. `report` sends a REPORT
(docs/PROTOCOL.md) on the open connection, which no reply answers.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable, Sequence

from dlfsd.base.buffers import lazy_buffer
from dlfsd.pool import protocol
from dlfsd.pool.peer import PeerError, PeerMiss, PeerRefused, PeerUnavailable, PeerUnreachable
from dlfsd.pool.protocol import LENGTH_PREFIX, Message, ProtocolError

_PREFIX = LENGTH_PREFIX.size
_SLACK = 0.05  # s a read may run over its timeout, to spare a clock-based call per frame
_shared_frame: memoryview | None = None  # the receive buffer of this process's clients
# read_many: requests sent together at most (their frames must fit a socket's smallest
# send buffer, see the module's docstring), and bytes they ask for (one read's worth)
BATCH_READS = 16
BATCH_BYTES = protocol.MAX_READ

#: One read of a batch: (dataset id, chunk, offset, length).
Read = tuple[bytes, int, int, int]
#: read_many's callback: (index in the batch, the bytes or the read's PeerMiss/PeerRefused).
#: The bytes are a view of the receive buffer, valid during the call only.
OnReply = Callable[[int, "bytes | memoryview | PeerError"], None]


def _receive_buffer() -> memoryview:
    """The process's receive buffer (a length prefix and the largest frame body), made
    when the first client is (the main daemon process, which has none, does not pay
    for it)."""
    global _shared_frame
    if _shared_frame is None:
        _shared_frame = _new_buffer()
    return _shared_frame


def _new_buffer() -> memoryview:
    return lazy_buffer(_PREFIX + protocol.MAX_FRAME)


class BlockingPeerClient:
    """Reads byte ranges from one peer; one connection, opened lazily, reopened after errors."""

    def __init__(self, secret: bytes, node_name: str, host: str, port: int, *,
                 timeout: float = 5.0, own_buffer: bool = False,
                 alt_ports: tuple[int, ...] = ()) -> None:
        """`own_buffer`: receive into a buffer of this client's own rather than the
        process's shared one, for a client used by a thread beside others (the
        stager's copy threads, dlfsd.pool.replicate). `alt_ports`: where the peer
        listens if `port` was taken on its host (dlfs.cluster.nodes.Node.alt_ports),
        tried in order when `port` refuses or fails the handshake."""
        self._secret = protocol.check_secret(secret)
        self.node_name = node_name
        self.ports = (port, *alt_ports)
        self._port_index = 0  # the port to try first: the one that last worked
        self.host, self.timeout = host, timeout
        self._use_port(0)
        self._sock: socket.socket | None = None
        self._session: protocol.ClientHandshake | None = None  # of the open connection
        self._version = protocol.PROTOCOL_VERSION  # lowered for a server that refused it
        self._next_id = 0
        # Shared (see the module's docstring) unless asked otherwise: a frame as it
        # came (prefix, body), and the body alone.
        self._frame = _new_buffer() if own_buffer else _receive_buffer()
        self._view = self._frame[_PREFIX:]
        self._replied = False  # a byte of the current reply has arrived
        self._deadline = 0.0  # of the read (or handshake) under way
        self._shortened = False  # the socket's kernel timeout is below `timeout`

    def read(self, dataset_id: bytes, chunk: int, offset: int,
             length: int) -> bytes | memoryview:
        """`length` bytes at `offset` of the chunk's data; PeerUnavailable / PeerMiss /
        PeerRefused (dlfsd.pool.peer), within `timeout` for the whole read,
        connecting and the handshake included.

        The bytes may be a view of the shared receive buffer: use them before the next
        read on any client of this process.
        """
        sock = self._sock
        reused = sock is not None
        if sock is not None:
            self._start_clock(sock)
        else:
            sock = self._connect()  # starts the read's clock
        self._next_id = (self._next_id + 1) % protocol.MAX_REQUEST_ID
        request_id = self._next_id
        request = protocol.read_frame(request_id, dataset_id, chunk, offset, length)
        # A length over MAX_READ gets no DATA (the server refuses it): nothing to expect.
        head = protocol.data_frame_head(request_id, length) if length <= protocol.MAX_READ \
            else b""
        expect = len(head) + length if head else 0
        try:
            try:
                size = self._exchange(sock, request, expect)
            except (ConnectionResetError, BrokenPipeError) as error:
                if not reused or self._replied:
                    raise
                sock = self._reconnect(error)
                size = self._exchange(sock, request, expect)
            if size + _PREFIX == expect and self._frame[: len(head)] == head:
                return self._view[len(head) - _PREFIX : size]  # the expected DATA frame
            reply = protocol.decode_body(self._view[:size])
        except (OSError, ProtocolError) as error:  # socket.timeout is an OSError
            self.close()
            raise PeerUnavailable(f"peer {self.address}: {self._why(error)}") \
                from None
        if reply.get("id") != request_id:
            self.close()
            raise PeerUnavailable(f"peer {self.address} answered another request")
        return self._result(reply, dataset_id, chunk, offset, length)

    def read_many(self, reads: Sequence[Read], on_reply: OnReply) -> None:
        """Read several ranges pipelined (see the module's docstring): `on_reply(i,
        result)` once per read, in the order the replies come (today's server: the
        order of `reads`), with its bytes (a view valid during the call only) or its
        PeerMiss / PeerRefused, each checked as `read` checks one.

        PeerUnavailable for the connection (lost, timed out, a reply that breaks the
        protocol): raised once the replies before it were handed out; the reads not
        answered yet got no call. The connection is then closed; the next read opens
        another. An exception of `on_reply` closes it too (replies are still on their
        way) and propagates."""
        start = 0
        while start < len(reads):
            end, asked = start + 1, reads[start][3]
            while end < len(reads) and end - start < BATCH_READS \
                    and asked + reads[end][3] <= BATCH_BYTES:
                asked += reads[end][3]
                end += 1
            self._read_round(reads, start, end, on_reply)
            start = end

    def _read_round(self, reads: Sequence[Read], start: int, end: int,
                    on_reply: OnReply) -> None:
        """Send reads[start:end] in one go and hand out their replies, within one
        `timeout` (a round asks for at most BATCH_BYTES)."""
        sock = self._sock
        reused = sock is not None
        if sock is not None:
            self._start_clock(sock)
        else:
            sock = self._connect()
        pending: dict[int, int] = {}  # request id -> index in `reads`
        frames = []
        for index in range(start, end):
            self._next_id = (self._next_id + 1) % protocol.MAX_REQUEST_ID
            pending[self._next_id] = index
            frames.append(protocol.read_frame(self._next_id, *reads[index]))
        request = b"".join(frames)
        try:
            try:
                self._replied = False
                sock.sendall(request)
                have = self._take_reply(sock, reads, pending, 0, on_reply)
            except (ConnectionResetError, BrokenPipeError) as error:
                if not reused or self._replied:
                    raise
                sock = self._reconnect(error)  # closed while idle: the whole round again
                sock.sendall(request)
                have = self._take_reply(sock, reads, pending, 0, on_reply)
            while pending:
                have = self._take_reply(sock, reads, pending, have, on_reply)
            if have:
                raise ProtocolError("the peer sent more than the replies asked for")
        except (OSError, ProtocolError) as error:
            self.close()
            raise PeerUnavailable(f"peer {self.address}: {self._why(error)}") from None
        except BaseException:
            self.close()  # replies may still be on their way: the connection is spent
            raise

    def _take_reply(self, sock: socket.socket, reads: Sequence[Read], pending: dict[int, int],
                    have: int, on_reply: OnReply) -> int:
        """Receive the next reply of a round (`have` bytes of it are at the buffer's
        start already) and hand it to `on_reply`; returns how many bytes of the replies
        after it came with it (moved to the buffer's start). The fast path expects a
        DATA for the oldest request pending, as `read` expects one for its request."""
        request_id = next(iter(pending))
        index = pending[request_id]
        length = reads[index][3]
        head = protocol.data_frame_head(request_id, length) if length <= protocol.MAX_READ \
            else b""
        expect = len(head) + length if head else 0
        size, got = self._receive_next(sock, expect, have)
        end = _PREFIX + size
        if end == expect and self._frame[: len(head)] == head:
            del pending[request_id]
            on_reply(index, self._view[len(head) - _PREFIX : size])
        else:
            reply = protocol.decode_body(self._view[:size])
            index = pending.pop(reply.get("id", -1), -1)
            if index < 0:
                raise ProtocolError("answered a request it was not sent")
            on_reply(index, self._checked_reply(reply, *reads[index]))
        rest = got - end
        if rest:  # the next replies' first bytes (this one was shorter than hoped for)
            self._frame[:rest] = bytes(self._frame[end:got])
        return rest

    def _checked_reply(self, reply: Message, dataset_id: bytes, chunk: int, offset: int,
                       length: int) -> bytes | PeerError:
        """A reply of a batch as `_result` takes one, its PeerMiss / PeerRefused
        returned; a reply that breaks the connection raises ProtocolError."""
        if reply["t"] not in (protocol.DATA, protocol.MISS, protocol.FAIL):
            raise ProtocolError(f"sent {reply['t']} instead of a reply")
        if reply["t"] == protocol.DATA and len(reply["data"]) != length:
            raise ProtocolError(f"sent {len(reply['data'])} bytes of chunk {chunk}, "
                                f"not {length}")
        where = f"chunk {chunk} of dataset {dataset_id.hex()} on peer {self.address}"
        try:
            return reply_bytes(reply, where, offset, length)
        except PeerError as error:
            return error

    def _exchange(self, sock: socket.socket, request: bytes, expect: int) -> int:
        """Send a request and receive its reply's frame (`expect`: the size of the
        reply hoped for, prefix included); returns the body's size."""
        self._replied = False
        sock.sendall(request)
        return self._receive_frame(sock, expect)

    def _reconnect(self, error: OSError) -> socket.socket:
        """A new connection for a request the kept one could not carry: the server
        closed it before the request came (idle timeout, restart), which says nothing
        about the peer's health. Within the read's deadline; the cause of the retry
        goes into the message if connecting fails too."""
        self.close()
        try:
            return self._connect(self._deadline)
        except PeerUnavailable as failure:
            raise PeerUnavailable(f"{failure} (after the connection in use was lost: "
                                  f"{self._why(error)})") from None

    def _result(self, reply: Message, dataset_id: bytes, chunk: int, offset: int,
                length: int) -> bytes:
        where = f"chunk {chunk} of dataset {dataset_id.hex()} on peer {self.address}"
        if reply["t"] not in (protocol.DATA, protocol.MISS, protocol.FAIL):
            self.close()
            raise PeerUnavailable(f"peer {self.address} sent {reply['t']} instead of a reply")
        if reply["t"] == protocol.DATA and len(reply["data"]) != length:
            self.close()
            raise PeerUnavailable(f"{where}: sent {len(reply['data'])} bytes, not {length}")
        return reply_bytes(reply, where, offset, length)

    def report(self, bad: protocol.BadRange) -> bool:
        """Tell the peer that its bytes of `bad` failed their checksum here (best effort,
        no reply). False if it cannot be told: no connection open (the read that got the
        bytes just used one), a version 1 peer, or the send failed."""
        if self._sock is None or self._session is None or not self._session.reports:
            return False
        try:
            self._sock.sendall(protocol.encode(self._session.report(bad)))
        except OSError:
            self.close()
            return False
        return True

    def _why(self, error: Exception) -> str:
        """One readable cause; a kernel socket timeout shows up as EAGAIN."""
        if isinstance(error, BlockingIOError):
            return f"no answer within {self.timeout:g} s"
        return str(error) or type(error).__name__

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
            self._session = None

    # -- connection ------------------------------------------------------------------
    def _use_port(self, index: int) -> None:
        self.port = self.ports[index]
        host, port = self.host, self.port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _connect(self, deadline: float | None = None) -> socket.socket:
        """Connect and shake hands by `deadline` (default: `timeout` from now), on the
        peer's port, or the first of its other ports that takes us: a port taken on its
        host by something else (a process that refuses us, another job's daemon that
        fails our secret) makes the peer listen on the next one (dlfs.cluster.slurm).
        The port that worked is tried first next time; after a failure, the next one
        is. Unreachable (PeerUnreachable) if any port refused the connection, else the
        first failure."""
        self._deadline = time.monotonic() + self.timeout if deadline is None else deadline
        failures: list[PeerUnavailable] = []
        count = len(self.ports)
        for step in range(count):
            index = (self._port_index + step) % count
            self._use_port(index)
            try:
                sock = self._connect_any_version()
            except PeerUnavailable as failure:
                failures.append(failure)
                continue
            self._port_index = index
            return sock
        self._port_index = (self._port_index + 1) % count
        if count == 1:
            raise failures[0]
        unreachable = any(isinstance(f, PeerUnreachable) for f in failures)
        message = "; ".join(str(f) for f in failures)
        raise (PeerUnreachable if unreachable else PeerUnavailable)(message)

    def _connect_any_version(self) -> socket.socket:
        """Connect to `self.port`, in the oldest version we speak if the server refuses
        ours."""
        try:
            return self._connect_speaking(self._version)
        except protocol.VersionRefused as refused:
            if self._version == protocol.MIN_PROTOCOL_VERSION:
                raise PeerUnavailable(f"peer {self.address} {refused}") from None
        self._version = protocol.MIN_PROTOCOL_VERSION
        return self._connect_speaking(self._version)

    def _connect_speaking(self, version: int) -> socket.socket:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise PeerUnavailable(f"cannot connect to peer {self.address}: no time left "
                                  f"of the read's {self.timeout:g} s")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=left)
        except OSError as error:
            raise PeerUnreachable(f"cannot connect to peer {self.address}: "
                                  f"{error.strerror or error}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _kernel_timeouts(sock, max(self._deadline - time.monotonic(), 0.001))
        self._shortened = True
        try:
            self._session = self._handshake(sock, version)
        except (OSError, ProtocolError) as error:
            sock.close()
            raise PeerUnavailable(f"handshake with peer {self.address} failed: "
                                  f"{self._why(error)}") \
                from None
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return sock

    def _handshake(self, sock: socket.socket, version: int) -> protocol.ClientHandshake:
        """protocol.ClientHandshake decides, this moves its messages.
        Returns it: REPORTs on this connection are made with its nonces."""
        shake = protocol.ClientHandshake(self._secret, self.node_name, version)
        sock.sendall(protocol.encode(shake.hello()))
        try:
            sock.sendall(protocol.encode(shake.auth_for(self._receive(sock))))
            shake.finish(self._receive(sock))
            return shake
        except protocol.VersionRefused:
            raise
        except protocol.HandshakeFailed as failed:
            if failed.reply is not None:
                with contextlib.suppress(OSError):
                    sock.sendall(protocol.encode(failed.reply))
            raise PeerUnavailable(f"peer {self.address} {failed}") from None

    # -- frames ---------------------------------------------------------------------
    def _receive(self, sock: socket.socket) -> Message:
        return protocol.decode_body(self._view[: self._receive_frame(sock)])

    def _receive_frame(self, sock: socket.socket, expect: int = 0) -> int:
        """Receive one frame (prefix and body) into the buffer; returns the body's size.

        `expect`: the size of the frame the caller hopes for, prefix included (0: none).
        The first receive then takes whatever of it has come, in one call; a frame of
        another size is received the general way. With one request in flight nothing
        may follow the reply: bytes past its end break the stream (ProtocolError)."""
        frame = self._frame
        got = 0
        if expect:
            got = sock.recv_into(frame[:expect])
            if not got:
                raise ConnectionResetError("connection closed by the peer")
            self._replied = True
        if got < _PREFIX:
            self._fill(sock, frame[got:_PREFIX])
            got = _PREFIX
        size = self._frame_body(sock, got)
        if got > _PREFIX + size:
            raise ProtocolError("the peer sent more than the one reply asked for")
        return size

    def _frame_body(self, sock: socket.socket, got: int) -> int:
        """The frame whose prefix and `got` bytes in all are in the buffer: checks its
        size and receives the rest of its body (no further); returns the body's size."""
        (size,) = LENGTH_PREFIX.unpack_from(self._frame)
        if size > protocol.MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds the limit of "
                                f"{protocol.MAX_FRAME}")
        end = _PREFIX + size
        if got < end:
            self._bound_by_deadline(sock, got, end)
            self._fill(sock, self._frame[got:end])
        return size

    def _receive_next(self, sock: socket.socket, expect: int, have: int) -> tuple[int, int]:
        """`_receive_frame` for a reply of a batch: `have` bytes of it are in the buffer
        already, and bytes past its end are the next replies' (they stay, for the
        caller). Returns (the body's size, the bytes in the buffer)."""
        frame = self._frame
        got = have
        if got < _PREFIX and expect:
            self._bound_by_deadline(sock, got, expect)  # the round's deadline, not a new one
            n = sock.recv_into(frame[got:expect])
            if not n:
                raise ConnectionResetError("connection closed by the peer")
            self._replied = True
            got += n
        if got < _PREFIX:
            self._bound_by_deadline(sock, got, _PREFIX)
            self._fill(sock, frame[got:_PREFIX])
            got = _PREFIX
        size = self._frame_body(sock, got)
        return size, max(got, _PREFIX + size)

    def _bound_by_deadline(self, sock: socket.socket, got: int, want: int) -> None:
        """Before a receive: if the read's time is running out, cut the kernel timeout
        to what is left. A prefix (or the part of a frame) that came late must not buy
        the rest a full `timeout` again. A quick reply costs one clock read, no call."""
        left = self._deadline - time.monotonic()
        if left > self.timeout - _SLACK:
            return
        if left <= 0:  # must not hold a worker past the read's own timeout
            raise TimeoutError(f"only {got} of {want} bytes within {self.timeout:g} s")
        _kernel_timeouts(sock, max(left, 0.001))  # 0 would mean: wait forever
        self._shortened = True

    def _start_clock(self, sock: socket.socket) -> None:
        """A read (or a handshake) has `timeout` in all from now."""
        self._deadline = time.monotonic() + self.timeout
        if self._shortened:
            _kernel_timeouts(sock, self.timeout)
            self._shortened = False

    def _fill(self, sock: socket.socket, view: memoryview) -> None:
        got = 0
        while got < len(view):
            # MSG_WAITALL: the kernel gathers the arriving segments; it returns early
            # only on a timeout, a signal or the end of the connection.
            n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
            if not n:
                raise ConnectionResetError("connection closed by the peer")
            self._replied = True
            got += n
            if got < len(view):  # cut short by the kernel timeout: part of it came
                self._bound_by_deadline(sock, got, len(view))  # a peer trickling bytes


def reply_bytes(reply: Message, where: str, offset: int, length: int) -> bytes:
    """The payload of a DATA reply to a READ; PeerMiss or PeerRefused for MISS or FAIL.

    The caller has checked that the reply answers its request.
    """
    if reply["t"] == protocol.DATA:
        return reply["data"]
    if reply["t"] == protocol.MISS:
        raise PeerMiss(f"{where} is not staged")
    code = reply["code"]
    if code in protocol.BOUNDS_FAIL_CODES:
        raise PeerRefused(f"{where}: read of {length} bytes at {offset} refused ({code})", code)
    raise PeerMiss(f"{where}: the peer could not read it ({code})", code)


def _kernel_timeouts(sock: socket.socket, timeout: float) -> None:
    """Make `sock` blocking with the timeout enforced by the kernel (SO_RCVTIMEO/SNDTIMEO).

    Python's own socket timeout polls before every send and receive: one more
    system call each, on every peer read. A kernel timeout ends a call the same
    way (EAGAIN -> BlockingIOError, an OSError like socket.timeout).
    """
    seconds = int(timeout)
    timeval = struct.pack("@ll", seconds, int((timeout - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.settimeout(None)

"""PeerLoopServer: the peer protocol served by a selector loop (or a few, on threads).

One server of the daemon's: the daemon runs one in each of its `--peer-procs`
processes, all accepting on one port (dlfsd.pool.peerprocs), because threads of
one process share its GIL. Why a loop and not a thread per connection: every
blocking call releases and re-takes the GIL, and with one thread per peer
connection (a reader daemon opens one per worker process) the threads fought
over it: strace showed ~36 futex calls per 110 KiB read served, and the
server cost more CPU than the reads themselves. Here a loop thread owns each
connection with non-blocking sockets; a READ is answered as soon as its frame
is complete. `threads` loops (serve_threads(): DLFS_PEER_LOOPS, default 1)
share the connections: every loop accepts and hands each new one to the next
loop in turn. A loop spends much of a READ in system calls that release the
GIL, so a second loop serves while the first is in the kernel, up to about one
core: on 16 cores (bench/peer_serve.py, 8 clients) 1 loop served 21,158 READs/s
at 47 us of CPU each, 8 loops 16,089 at 103 us. Processes scale; loops do not.

Zero copy (`sendfile=True`; off by default): a READ whose range is in the
page cache (a non-blocking one-byte read of its first and last byte says so)
and whose connection has nothing queued is answered with the frame head
(MSG_MORE) and os.sendfile from the staged chunk file into the socket. What
the socket does not take at once is read into memory and queued (no
descriptor is kept past the call: an evicted copy's descriptor number may be
reused). With --verify-served the bytes must be hashed, so they are read as
before. Why off: over loopback (and so a veth pair) the receiver copies
anyway, and bench/peer_serve.py measured 110 KiB READs at 62-70 us of server
CPU with sendfile against 49-50 us copied (sendfile alone 53, the two probes
the rest); a NIC that gathers from the page cache may turn that around, which
nobody has measured yet.

The wire protocol is docs/PROTOCOL.md (dlfsd.pool.protocol): the secret is proven
both ways before anything else is answered, frames are capped at
MAX_CONTROL_FRAME, every READ is bounds-checked, a protocol error closes the
connection with one log line (after telling the peer why) and never stops the
server. Pipelined requests
on one connection are answered in order; while a reply cannot be sent
(the peer is not reading) that connection is not read either.

A READ that cannot be sent that way, with its bytes in the page cache, is
answered at once (read without blocking into one reused buffer, then one
sendmsg of head and payload). One that must wait for the disk goes to a small pool of disk
threads and the loop serves other peers meanwhile: waiting on each disk
read in turn would serialize every peer's reads at a queue depth of one.

Bad copies: a staged copy can go bad after it was checked (bit rot, a
truncated file), and peers would be served its wrong bytes for as long as it
lives. A peer whose bytes failed their checksum sends a REPORT of the range
(protocol version 2); the server checks those extents of its copy on a disk
thread and evicts and re-stages a bad copy at once. Reports are rate limited
here too (REPORT_CHECKS_PER_SECOND, and one check per chunk per
REPORT_COOLDOWN), so a peer, or a rotting disk, cannot keep the disk threads
busy hashing. With `verify_served` (--verify-served) the server also checks
each extent the first time the current copy serves it: wrong bytes then
never leave this node, at the cost of hashing each extent once per copy.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from dlfs.store.format import checksum
from dlfsd.base.buffers import lazy_buffer
from dlfsd.base.nowait import HAVE_NOWAIT, read_cached_into
from dlfsd.base.throttle import TokenBucket
from dlfsd.pool import protocol
from dlfsd.pool.admission import Admission, HandshakeFailureLog, RefusalLog, plain_ip
from dlfsd.pool.protocol import BadRange, FrameDecoder, Message, ProtocolError

log = logging.getLogger("dlfsd.pool.peer")

_RECV = 256 * 1024
_SWEEP = 0.25  # seconds between timeout checks
_GOODBYE = 1.0  # seconds a closing connection may take to read our last message
REPORT_CHECKS_PER_SECOND = 10.0  # re-checks of reported ranges, all peers together
REPORT_COOLDOWN = 2.0  # seconds a chunk just checked for a report is not checked again
MIN_CONNECTIONS = 256
MIN_THREADS, MAX_THREADS = 4, 8
LOOPS_VAR = "DLFS_PEER_LOOPS"  # loop threads per server process; default 1 (see below)


def serve_threads() -> int:
    """Loop threads per peer server process: DLFS_PEER_LOOPS, else one.

    Several loops (`auto`: sized from the cores, MIN_THREADS to MAX_THREADS) share one
    GIL: on one core 2 loops served 1.2x the READs/s of one, on 16 cores 8 loops
    served less than one (bench/peer_serve.py); the daemon scales with processes
    (`dlfs mount --peer-procs`) instead. (With several loops the 16-daemon test once
    saw handshakes unanswered for over 2 s: a start-up race, fixed; see start().)"""
    wanted = os.environ.get(LOOPS_VAR, "1")
    if wanted != "auto":
        try:
            return max(1, min(MAX_THREADS, int(wanted)))
        except ValueError:
            return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(MIN_THREADS, min(MAX_THREADS, cores))


class _Locked:
    """Calls into a shared object (admission, the handshake log) from several loop
    threads, one at a time; attributes read through."""

    def __init__(self, target, lock: threading.Lock) -> None:
        self._target, self._lock = target, lock

    def __getattr__(self, name: str):
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def locked(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)
        return locked
STRANGER_MARGIN = 64  # slots beyond the job's own: strangers being refused, reconnects


def connection_slots(nodes: int, workers: int) -> int:
    """Connection slots a daemon's peer server needs: every other node may hold a
    connection from each of its processes that read from peers (each worker, or two
    for a single-process mount, and the look-ahead's probe client), kept while they
    are used (the idle timeout is minutes). A fixed 256 was full at ~29 nodes of
    8-worker daemons; the refused peers then looked down and their reads went to the
    store (docs/SCALE.md)."""
    per_node = max(workers, 2) + 1
    return max(MIN_CONNECTIONS, (nodes - 1) * per_node + STRANGER_MARGIN)


class BlockingChunkProvider(Protocol):
    def chunk_limit(self, dataset_id: bytes, chunk: int) -> int | None: ...

    def staged_file(self, dataset_id: bytes, chunk: int) -> tuple[int, int] | None:
        """(open fd, position of the chunk's data in it) of the staged copy, or None
        if it is not staged here. May block (it may open the file)."""

    def will_stage(self, dataset_id: bytes, chunk: int) -> bool:
        """Whether a chunk that is not staged here will be soon: False (answered FAIL
        `not-staging` instead of MISS) when it is over the --cache-limit or the cache
        disk cannot be written, so a peer waiting for it goes elsewhere at once."""

    def check_copy(self, dataset_id: bytes, chunk: int, offset: int,
                   length: int) -> bool | None:
        """Check the extents of the staged copy a reported range overlaps; evict a bad
        copy. True if evicted, False if it checks out, None if nothing is staged. Blocks."""

    def serve_check(self, dataset_id: bytes, chunk: int, offset: int,
                    length: int) -> tuple[int, int, int] | None:
        """(extent, checksum, copy generation) if this READ is a whole extent the current
        copy has not served yet (--verify-served), else None."""

    def served_checked(self, dataset_id: bytes, ext: int, gen: int) -> None:
        """That extent checked out in that copy: not again for it."""

    def staged_copy_failed(self, dataset_id: bytes, chunk: int, fd: int) -> bool:
        """The staged copy could not be read through `fd` (-1: could not be opened):
        stop using it and stage it again, unless it was replaced meanwhile. True if a
        copy was evicted."""


class _Conn:
    """One peer connection: where its handshake is, what is received and unsent."""

    __slots__ = ("closing", "deadline", "decoder", "events", "handshake", "inbox", "ip", "out",
                 "peer", "sock", "state", "waiting")

    def __init__(self, sock: socket.socket, ip: str, peer: str, deadline: float,
                 handshake: protocol.ServerHandshake) -> None:
        self.sock, self.peer, self.deadline, self.handshake = sock, peer, deadline, handshake
        self.ip = ip
        self.decoder = FrameDecoder(protocol.MAX_CONTROL_FRAME)
        self.state = "hello"  # -> "auth" -> "ready"
        self.closing = False  # our last message is queued; drain, then close
        self.waiting = False  # a disk thread is reading the data of our next reply
        self.inbox: collections.deque[Message] = collections.deque()
        self.out: collections.deque[memoryview] = collections.deque()
        self.events = 0


COUNTERS = ("connections_accepted", "connections_rejected", "connections_open",
            "auth_failures", "protocol_errors", "reads_served", "reads_missed",
            "reads_refused", "read_errors", "bytes_served", "reads_from_disk",
            "replies_waited",  # replies that had to wait for the peer to read
            # REPORTs: checked and bad (evicted), checked and good (or not staged),
            # out of bounds, dropped by the rate limits
            "reports_received", "reports_confirmed", "reports_unconfirmed",
            "reports_refused", "reports_dropped",
            "served_checks", "served_bad")  # --verify-served
_INDEX = {name: i for i, name in enumerate(COUNTERS)}
OPEN = _INDEX["connections_open"]


def counter_row() -> memoryview:
    """One loop's counters (int64 each, COUNTERS order), private to this process; a
    forked server's live in shared memory instead (dlfsd.pool.peerprocs)."""
    return memoryview(bytearray(8 * len(COUNTERS))).cast("q")


class PeerLoopServer:
    """Serves byte ranges of staged chunks to authenticated peers from one thread."""

    def __init__(self, secret: bytes, provider: BlockingChunkProvider, node_name: str, *,
                 handshake_timeout: float = 5.0, idle_timeout: float = 300.0,
                 max_connections: int = MIN_CONNECTIONS, disk_threads: int = 4,
                 trusted: frozenset[str] | None = None, verify_served: bool = False,
                 threads: int = 1, sendfile: bool = False,
                 counts: Sequence[memoryview] | None = None,
                 open_connections: Callable[[], int] | None = None, processes: int = 1,
                 _front: PeerLoopServer | None = None) -> None:
        """`trusted`: the addresses of the job's nodes (None: treat every address so);
        see dlfsd.pool.admission for what strangers may do. `verify_served`: check
        each extent the first time the current copy serves it. `threads`: loops
        (serve_threads()). `sendfile`: answer cached READs with os.sendfile (see the
        module's docstring for why it is off by default).

        Serving from several processes (dlfsd.pool.peerprocs), each a server of its
        own on one listening socket: `counts` are this server's counter rows (one per
        loop, e.g. in shared memory; counts grow from what they hold), and
        `open_connections` counts the node's open connections for
        `max_connections`; the other per-node limits (unauthenticated connections
        per source and from strangers, report checks per second) are split between
        the `processes`."""
        self._secret = protocol.check_secret(secret)
        self.provider = provider
        self.node_name = node_name
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.admission = Admission(trusted, max_connections, share=processes)
        self._refusals = RefusalLog()
        self.handshake_failures = HandshakeFailureLog()  # summed up, not a line each
        rows = list(counts) if counts is not None else [counter_row() for _ in range(threads)]
        self._counts = rows[0]  # written by this loop's thread only
        self._open_connections = open_connections or self._open_in_shards
        self._conns: dict[socket.socket, _Conn] = {}
        self._inbuf = bytearray(_RECV)  # one loop thread: one receive buffer for all
        self._readbuf = lazy_buffer(protocol.MAX_READ)  # and one read buffer
        self._nowait = HAVE_NOWAIT
        self._sendfile = sendfile and HAVE_NOWAIT and hasattr(os, "sendfile")
        self._probe = bytearray(1)  # the one-byte reads that say a range is cached
        self._incoming: collections.deque = collections.deque()  # handed over by the first loop
        self._shards: list[PeerLoopServer] = [self]
        self._lock = threading.Lock() if _front is None else _front._lock  # shared state
        if _front is not None:  # another loop of the same server: share what is the server's
            self.admission, self._refusals = _front.admission, _front._refusals
            self.handshake_failures, self._disk = _front.handshake_failures, _front._disk
        else:
            self._disk = concurrent.futures.ThreadPoolExecutor(
                disk_threads, thread_name_prefix="dlfsd.pool.peer disk")
            if threads > 1:
                lock = self._lock
                self.admission = _Locked(self.admission, lock)
                self._refusals = _Locked(self._refusals, lock)
                self.handshake_failures = _Locked(self.handshake_failures, lock)
                self._shards += [PeerLoopServer(
                    secret, provider, node_name, handshake_timeout=handshake_timeout,
                    idle_timeout=idle_timeout, max_connections=max_connections,
                    trusted=trusted, verify_served=verify_served, sendfile=sendfile,
                    counts=[row], _front=self) for row in rows[1:threads]]
        self._front = _front
        self._next_shard = 0
        self._finished: collections.deque = collections.deque()  # disk reads done
        self._checked: collections.deque = collections.deque()  # reports checked
        self.verify_served = verify_served
        rate = REPORT_CHECKS_PER_SECOND / max(1, processes)
        self._report_budget = TokenBucket(rate, max(1, int(rate)))
        self._reported: dict[tuple[bytes, int], float] = {}  # (dataset, chunk) -> when
        self._failed_chunks: set[tuple[bytes, int]] = set()  # logged once each
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- lifecycle ------------------------------------------------------------------
    def start(self, host: str, port: int) -> int:
        """Bind and listen now (errors raise here), serve in `threads` threads; returns
        the port."""
        bound = self.serve_on(listen(host, port))
        log.info("peer server of %s listening on %s:%d (%d loop threads)", self.node_name,
                 host, bound, len(self._shards))
        return bound

    def serve_on(self, listener: socket.socket) -> int:
        """Serve connections of a listening socket in `threads` threads (stop() closes
        it); returns its port."""
        listener.setblocking(False)
        self._listener = listener
        bound = listener.getsockname()[1]
        # Every loop is ready to be handed a connection before any accepts one: the
        # first loop used to accept (peers connect the moment the port listens) while
        # the next had no wake-up socket yet, died of it, and the connections handed
        # to it later were never answered (tests/test_pool_scale, issue 33).
        for shard in self._shards:
            shard._listener = listener
            shard._prepare_loop()
        for index, shard in enumerate(self._shards):
            shard._start_loop(f"{bound}.{index}")
        return bound

    def _prepare_loop(self) -> None:
        """Every loop accepts (whichever is free first: a loop stuck on a slow disk
        call must not keep peers from connecting) and hands the connection to the
        next loop in turn."""
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full pipe means a wake-up is pending anyway
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")

    def _start_loop(self, name: str) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"dlfsd.pool.peer server {name}")
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and drop every connection; returns once the loops have ended."""
        for shard in self._shards:
            shard._stopping = True
            if shard._wake_w is not None:
                with contextlib.suppress(OSError):
                    shard._wake_w.send(b"x")
        for shard in self._shards:
            if shard._thread is not None:
                shard._thread.join(timeout=5)
        if self._listener is not None:  # every loop has stopped watching it
            self._listener.close()

    def serving(self) -> bool:
        """Every loop still runs: one ends only by stop() or an unexpected error (logged)."""
        return all(shard._thread is not None and shard._thread.is_alive()
                   for shard in self._shards)

    def counters(self) -> dict[str, int]:
        """Every loop's counters, summed."""
        return sum_rows(shard._counts for shard in self._shards)

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[_INDEX[name]] += n

    def _open_in_shards(self) -> int:
        return sum(shard._counts[OPEN] for shard in (self._front or self)._shards)

    # -- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        next_sweep = time.monotonic() + _SWEEP
        try:
            while not self._stopping:
                for key, events in self._selector.select(timeout=_SWEEP):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._finish_disk_reads()
                    elif isinstance(key.data, _Conn):
                        self._guarded(key.data, events)
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP
        except Exception:
            log.exception("peer server of %s stopped by an unexpected error", self.node_name)
        finally:
            if self._front is None:
                self._disk.shutdown(wait=False, cancel_futures=True)
            while self._incoming:  # handed over, never watched
                self._incoming.popleft().sock.close()
            for conn in list(self._conns.values()):
                self._close(conn)
            for sock in (self._wake_r, self._wake_w):  # the listener: closed by stop()
                if sock is not None:
                    sock.close()
            self._selector.close()

    def _accept(self) -> None:
        """One connection per wake-up, not all that wait: where several processes
        accept on one socket, each that is free takes one in turn (the kernel wakes
        them all), so a burst of connections (a reading node's workers) spreads over
        them instead of landing in the process that woke first."""
        try:
            sock, address = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as error:  # e.g. EMFILE for a moment; keep serving
            log.warning("peer server: cannot accept a connection: %s", error)
            return
        ip = plain_ip(address[0])
        refused = self.admission.admit(ip, self._open_connections())
        if refused is not None:
            self._count("connections_rejected")
            self._refusals.refused(ip, refused)
            sock.close()
            return
        self._count("connections_accepted")
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, ip, _address(address), time.monotonic() + self.handshake_timeout,
                     protocol.ServerHandshake(self._secret, self.node_name))
        front = self._front or self
        shards = front._shards
        turn = front._next_shard  # (two loops taking the same turn: harmless)
        front._next_shard = (turn + 1) % len(shards)
        shard = shards[turn]
        if shard is self:
            self._adopt(conn)
        else:  # that loop watches it from now on
            shard._incoming.append(conn)
            with contextlib.suppress(OSError):
                shard._wake_w.send(b"c")

    def _adopt(self, conn: _Conn) -> None:
        """Watch a connection the first loop accepted (in the loop that serves it)."""
        self._count("connections_open")
        self._conns[conn.sock] = conn
        self._watch(conn, selectors.EVENT_READ)

    def _sweep(self, now: float) -> None:
        self._refusals.flush()
        self.handshake_failures.flush()
        for conn in [c for c in self._conns.values() if now > c.deadline]:
            if conn.state != "ready" and not conn.closing:  # never proved the secret
                self._count("protocol_errors")
                self.handshake_failures.failed(
                    conn.ip, f"no handshake within {self.handshake_timeout:.1f} s",
                    f"peer {conn.peer}: no handshake within {self.handshake_timeout:.1f} s; "
                    "closing the connection")
            elif not conn.closing:  # (a goodbye not taken in time was logged when sent)
                log.info("peer %s: idle for %.0f s; closing the connection", conn.peer,
                         self.idle_timeout)
            self._close(conn)

    def _guarded(self, conn: _Conn, events: int) -> None:
        """Handle one connection's events; nothing that happens here may escape."""
        if conn.sock in self._conns:  # else closed earlier in this round of events
            self._guarded_call(conn, self._events, conn, events)

    def _events(self, conn: _Conn, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
            if not conn.out and not conn.closing and conn.sock in self._conns:
                self._pump(conn)  # answer what arrived while the reply was queued
        if events & selectors.EVENT_READ and conn.sock in self._conns:
            self._receive(conn)

    def _guarded_call(self, conn: _Conn, handler, *args) -> None:
        """Run a handler of `conn`; an error closes that connection, never the loop."""
        try:
            handler(*args)
        except ProtocolError as error:
            self._count("protocol_errors")
            if conn.state == "ready":  # a peer that proved the secret: worth a line each
                log.warning("peer %s: protocol error: %s; closing the connection",
                            conn.peer, error)
            else:
                self.handshake_failures.failed(
                    conn.ip, "protocol error before the handshake",
                    f"peer {conn.peer}: protocol error: {error}; closing the connection")
            self._goodbye(conn, protocol.err(protocol.ERR_PROTOCOL, str(error)))
        except OSError as error:
            if not self._stopping:
                log.debug("peer %s: connection lost: %r", conn.peer, error)
            self._close(conn)
        except Exception:
            log.exception("peer %s: unexpected error; closing the connection", conn.peer)
            self._close(conn)

    # -- input --------------------------------------------------------------------------
    def _receive(self, conn: _Conn) -> None:
        try:
            n = conn.sock.recv_into(self._inbuf)
        except BlockingIOError:
            return
        if not n:
            if conn.decoder.buffered and not conn.closing:
                raise ProtocolError("connection closed in the middle of a frame")
            self._close(conn)
            return
        if conn.closing:  # draining until the peer has read our last message
            return
        if conn.state == "ready":  # a handshake keeps the deadline set at accept: one
            conn.deadline = time.monotonic() + self.idle_timeout  # byte at a time is no way
        with memoryview(self._inbuf)[:n] as data:  # the decoder copies what it keeps
            conn.inbox.extend(conn.decoder.feed(data))
        self._pump(conn)

    def _pump(self, conn: _Conn) -> None:
        """Answer received messages in order while replies go out; then wait for more."""
        while conn.inbox and not conn.out and not conn.closing and not conn.waiting:
            self._handle(conn, conn.inbox.popleft())
        if conn.sock in self._conns and not conn.out and not conn.waiting:
            self._watch(conn, selectors.EVENT_READ)

    def _handle(self, conn: _Conn, msg: Message) -> None:
        try:
            if conn.state == "ready":
                if msg["t"] == protocol.READ:
                    self._reply_to(conn, msg)
                elif msg["t"] == protocol.REPORT:
                    self._on_report(conn, conn.handshake.check_report(msg))
                else:
                    raise ProtocolError(f"unexpected {msg['t']} message after the handshake")
            elif conn.state == "hello":
                reply = conn.handshake.challenge_for(msg)
                conn.state = "auth"
                self._send(conn, protocol.encode(reply))
            else:
                reply = conn.handshake.accept(msg)
                conn.state, conn.deadline = "ready", time.monotonic() + self.idle_timeout
                self.admission.authenticated(conn.ip)
                self._send(conn, protocol.encode(reply))
        except protocol.HandshakeRefused as refused:
            self._count(refused.counter)
            self.handshake_failures.failed(
                conn.ip, refused.cause, f"peer {conn.peer} (node "
                f"{conn.handshake.client_node!r}): {refused.why}; closing the connection")
            if refused.reply is None:
                self._close(conn)
            else:
                self._goodbye(conn, refused.reply)

    def _reply_to(self, conn: _Conn, request: Message) -> None:
        """DATA, MISS or FAIL for one READ; provider failures become FAIL_IO."""
        request_id, dataset_id, chunk = request["id"], request["ds"], request["chunk"]
        offset, length = request["off"], request["len"]
        try:
            problem = protocol.read_bounds_problem(
                self.provider.chunk_limit(dataset_id, chunk), offset, length)
            if problem is not None:
                self._count("reads_refused")
                self._send(conn, protocol.encode(protocol.fail(request_id, problem)))
                return
            staged = self.provider.staged_file(dataset_id, chunk)
            check = None
            if staged is not None and self.verify_served:
                check = self.provider.serve_check(dataset_id, chunk, offset, length)
        except Exception as error:
            self._read_failed(conn, request_id, chunk, dataset_id, error)
            return
        if staged is None:
            self._count("reads_missed")
            reply = protocol.miss(request_id) if self.provider.will_stage(dataset_id, chunk) \
                else protocol.fail(request_id, protocol.FAIL_NOT_STAGING)
            self._send(conn, protocol.encode(reply))
            return
        fd, pos = staged[0], staged[1] + offset
        if self._sendfile and check is None and not conn.out and length:
            try:
                cached = self._range_cached(fd, pos, length)
            except OSError as error:
                self._read_failed(conn, request_id, chunk, dataset_id, error, fd)
                return
            if cached:
                self._send_file(conn, request_id, chunk, dataset_id, fd, pos, length)
                return
        # A copy cut short is caught by the reads themselves: a short non-blocking read
        # goes to a disk thread, whose exact read fails (no fstat per request).
        with self._readbuf[:length] as view:
            try:
                cached = self._read_cached(fd, view, pos)
            except OSError as error:
                self._read_failed(conn, request_id, chunk, dataset_id, error, fd)
                return
            if cached:
                if check is not None and not self._checks_out(dataset_id, check, view):
                    self._read_failed(conn, request_id, chunk, dataset_id,
                                      BadCopyError(check[0]), fd)
                    return
                self._serve(conn, request_id, view)
                return
        # Not all in the page cache: a disk thread reads it while this loop serves others
        # (one thread waiting on each disk read in turn would serialize every peer's).
        self._count("reads_from_disk")
        conn.waiting, conn.deadline = True, time.monotonic() + self.idle_timeout
        self._unwatch(conn)  # nothing more from this peer until this reply is out
        future = self._disk.submit(_pread_exact, fd, length, pos)
        future.add_done_callback(lambda f: self._disk_done(conn, request_id, chunk, dataset_id,
                                                           fd, check, f))

    def _checks_out(self, dataset_id: bytes, check: tuple[int, int, int], payload) -> bool:
        """--verify-served: the bytes of an extent about to be served for the first time
        from this copy match its checksum (then it is not checked again)."""
        ext, expected, gen = check
        self._count("served_checks")
        if checksum(payload) == expected:
            self.provider.served_checked(dataset_id, ext, gen)
            return True
        self._count("served_bad")
        return False

    # -- reports of bad copies ----------------------------------------------------------
    def _on_report(self, conn: _Conn, bad: BadRange) -> None:
        """A peer got bytes of `bad` that failed their checksum: check those extents of
        our copy on a disk thread, within the rate limits (no reply either way)."""
        self._count("reports_received")
        limit = self.provider.chunk_limit(bad.dataset_id, bad.chunk)
        if protocol.read_bounds_problem(limit, bad.offset, bad.length) is not None:
            self._count("reports_refused")
            return
        if not self._report_allowed(bad):
            self._count("reports_dropped")
            return
        future = self._disk.submit(self.provider.check_copy, bad.dataset_id, bad.chunk,
                                   bad.offset, bad.length)
        future.add_done_callback(lambda f: self._report_done(conn.peer, bad, f))

    def _report_allowed(self, bad: BadRange) -> bool:
        """One check per chunk per REPORT_COOLDOWN (a reading node's workers each report
        the same copy), and REPORT_CHECKS_PER_SECOND in all (every loop's: the first
        loop's records)."""
        front = self._front or self
        with front._lock:
            return front._report_allowed_locked(bad)

    def _report_allowed_locked(self, bad: BadRange) -> bool:
        now = time.monotonic()
        key = (bad.dataset_id, bad.chunk)
        if self._reported.get(key, 0.0) > now - REPORT_COOLDOWN:
            return False
        if not self._report_budget.take():
            return False
        if len(self._reported) >= 1024:  # forget what is past its cooldown
            self._reported = {k: t for k, t in self._reported.items()
                              if t > now - REPORT_COOLDOWN}
        self._reported[key] = now
        return True

    def _report_done(self, peer: str, bad: BadRange, future) -> None:
        """In a disk thread: hand the check's result to the loop thread."""
        self._checked.append((peer, bad, future))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"r")

    def _report_checked(self, peer: str, bad: BadRange, future) -> None:
        where = (f"chunk {bad.chunk} of dataset {bad.dataset_id.hex()} ({bad.length} bytes "
                 f"at {bad.offset})")
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or error is not None:
            self._count("reports_unconfirmed")
            log.error("peer %s reported %s bad; checking our copy failed: %r", peer, where,
                      error)
        elif future.result():
            self._count("reports_confirmed")
            log.error("peer %s got bytes of %s that fail their checksum: our staged copy is "
                      "bad there; evicted, staging it again", peer, where)
        else:
            self._count("reports_unconfirmed")
            log.warning("peer %s reported %s bad; our copy checks out there (or is gone); "
                        "kept", peer, where)

    def _read_failed(self, conn: _Conn, request_id: int, chunk: int, dataset_id: bytes,
                     error: Exception, fd: int = -1) -> None:
        """FAIL_IO for the request, counted. A copy that cannot be read is evicted and
        staged again (as a local reader does), logged once; a failure that evicts
        nothing is logged once per chunk, since every peer reading a broken copy would
        otherwise add a line per read."""
        self._count("read_errors")
        evicted = False
        if isinstance(error, OSError):  # the copy itself, not a bug of ours
            try:
                evicted = self.provider.staged_copy_failed(dataset_id, chunk, fd)
            except Exception:
                log.exception("peer server: cannot evict staged chunk %d of dataset %s",
                              chunk, dataset_id.hex())
        if evicted:  # later requests get MISS until it is staged again
            log.error("peer %s: cannot read staged chunk %d of dataset %s: %s; evicted, "
                      "staging it again", conn.peer, chunk, dataset_id.hex(), error)
        elif (dataset_id, chunk) in self._failed_chunks:
            log.debug("peer %s: cannot read chunk %d of dataset %s again: %s", conn.peer,
                      chunk, dataset_id.hex(), error)
        else:
            self._failed_chunks.add((dataset_id, chunk))
            log.error("peer %s: cannot read chunk %d of dataset %s: %s (later failures of "
                      "this chunk are counted in read_errors, not logged)", conn.peer, chunk,
                      dataset_id.hex(), error)
        self._send(conn, protocol.encode(protocol.fail(request_id, protocol.FAIL_IO)))

    def _read_cached(self, fd: int, view: memoryview, pos: int) -> bool:
        """Fill `view` from the page cache without blocking; False if it must wait for
        the disk (or this file system cannot say: then always False)."""
        if not self._nowait:
            return False
        try:
            return read_cached_into(fd, view, pos)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._nowait = False
            return False

    def _range_cached(self, fd: int, pos: int, length: int) -> bool:
        """Whether the first and the last byte of a range are in the page cache (a
        non-blocking one-byte read of each): a staged copy is written or read whole,
        so its middle is then too; if not, sendfile reads it from the disk, in this
        loop. False past the end of the file (a copy cut short: the disk thread's exact
        read says so)."""
        probe = self._probe
        try:
            return os.preadv(fd, [probe], pos + length - 1, os.RWF_NOWAIT) == 1 \
                and (length == 1 or os.preadv(fd, [probe], pos, os.RWF_NOWAIT) == 1)
        except BlockingIOError:
            return False
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._sendfile = self._nowait = False
            return False

    def _send_file(self, conn: _Conn, request_id: int, chunk: int, dataset_id: bytes,
                   fd: int, pos: int, length: int) -> None:
        """A DATA reply straight from the staged file: the head (MSG_MORE: it leaves
        with the first bytes), then sendfile. Whatever the socket does not take now is
        read and queued: no descriptor is kept for later."""
        head = protocol.data_frame_head(request_id, length)
        try:
            sent = conn.sock.send(head, socket.MSG_MORE)
        except BlockingIOError:
            sent = 0
        if sent < len(head):  # no room in the socket: the copying way
            try:
                payload = _pread_exact(fd, length, pos)
            except OSError as error:
                if sent:  # a partial head is out: nothing else can follow on this connection
                    raise
                self._read_failed(conn, request_id, chunk, dataset_id, error, fd)
                return
            self._count("reads_served")
            self._count("bytes_served", length)
            self._send(conn, head[sent:], payload)
            return
        self._count("reads_served")  # before the bytes leave: a peer may look at once
        self._count("bytes_served", length)
        try:
            done = os.sendfile(conn.sock.fileno(), fd, pos, length)
        except BlockingIOError:
            done = 0
        if done < length:  # the socket is full (or the copy ends early: raises, closes)
            try:
                self._send(conn, _pread_exact(fd, length - done, pos + done))
            except OSError as error:
                # The head promised `length` bytes: the peer sees the connection end.
                self._count("read_errors")
                with contextlib.suppress(Exception):
                    self.provider.staged_copy_failed(dataset_id, chunk, fd)
                log.error("peer %s: staged chunk %d of dataset %s failed while being sent: "
                          "%s; closing the connection", conn.peer, chunk, dataset_id.hex(),
                          error)
                self._close(conn)
        else:
            conn.deadline = time.monotonic() + self.idle_timeout

    def _serve(self, conn: _Conn, request_id: int, payload) -> None:
        """Send a DATA reply. If part of the reused read buffer must wait in the queue
        (the peer is slow to read), that part is copied: the next read overwrites it."""
        self._count("reads_served")
        self._count("bytes_served", len(payload))
        self._send(conn, protocol.data_frame_head(request_id, len(payload)), payload)
        if conn.out and conn.out[-1].obj is self._readbuf.obj:
            conn.out[-1] = memoryview(bytes(conn.out[-1]))

    # -- reads that wait for the disk -------------------------------------------------------
    def _disk_done(self, conn: _Conn, request_id: int, chunk: int, dataset_id: bytes, fd: int,
                   check: tuple[int, int, int] | None, future) -> None:
        """In a disk thread: hand the result to the loop thread."""
        self._finished.append((conn, request_id, chunk, dataset_id, fd, check, future))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"d")

    def _finish_disk_reads(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        while self._incoming:
            self._adopt(self._incoming.popleft())
        while self._checked:
            self._report_checked(*self._checked.popleft())
        while self._finished:
            conn, request_id, chunk, dataset_id, fd, check, future = self._finished.popleft()
            conn.waiting = False
            if conn.sock not in self._conns or future.cancelled():
                continue
            self._guarded_call(conn, self._answer_disk_read, conn, request_id, chunk,
                               dataset_id, fd, check, future)

    def _answer_disk_read(self, conn: _Conn, request_id: int, chunk: int, dataset_id: bytes,
                          fd: int, check: tuple[int, int, int] | None, future) -> None:
        error = future.exception()
        if error is None and check is not None \
                and not self._checks_out(dataset_id, check, future.result()):
            error = BadCopyError(check[0])
        if error is None:
            self._serve(conn, request_id, future.result())
        else:
            self._read_failed(conn, request_id, chunk, dataset_id, error, fd)
        if conn.sock in self._conns and not conn.out and not conn.closing:
            self._pump(conn)  # answer what this peer sent meanwhile, and listen again

    # -- output ---------------------------------------------------------------------------
    def _send(self, conn: _Conn, *parts) -> None:
        conn.out.extend(memoryview(p) for p in parts)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Send what the socket takes; wait for room for the rest, else carry on."""
        out = conn.out
        while out:
            try:
                sent = conn.sock.sendmsg(list(out)[:64])
            except BlockingIOError:
                break
            if conn.closing:
                conn.deadline = time.monotonic() + _GOODBYE
            elif conn.state == "ready":
                conn.deadline = time.monotonic() + self.idle_timeout
            while sent:
                head = out[0]
                if sent >= len(head):
                    sent -= len(head)
                    out.popleft()
                else:
                    out[0] = head[sent:]
                    sent = 0
        if out:
            if conn.events != selectors.EVENT_WRITE:
                self._count("replies_waited")
            self._watch(conn, selectors.EVENT_WRITE)
        elif conn.closing:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
            self._watch(conn, selectors.EVENT_READ)  # drain until the peer closes

    def _goodbye(self, conn: _Conn, msg: Message) -> None:
        """Send a last message, then drain briefly: closing with unread input would reset
        the connection and the peer might never see why."""
        if conn.sock not in self._conns:
            return
        conn.closing = True
        conn.inbox.clear()
        conn.deadline = time.monotonic() + _GOODBYE
        try:
            self._send(conn, protocol.encode(msg))
        except OSError:
            self._close(conn)

    def _watch(self, conn: _Conn, events: int) -> None:
        if conn.events == events or conn.sock not in self._conns:
            return
        if conn.events:
            self._selector.modify(conn.sock, events, conn)
        else:
            self._selector.register(conn.sock, events, conn)
        conn.events = events

    def _unwatch(self, conn: _Conn) -> None:
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0

    def _close(self, conn: _Conn) -> None:
        conn.closing = True
        conn.inbox.clear()
        if self._conns.pop(conn.sock, None) is None:
            return
        self._count("connections_open", -1)
        if conn.state != "ready":
            self.admission.closed_pending(conn.ip)
        if conn.events:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(conn.sock)
        conn.sock.close()


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (errors raise: the port is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        listener.setblocking(False)  # (shared by the processes that inherit it)
    except BaseException:
        listener.close()
        raise
    return listener


def sum_rows(rows) -> dict[str, int]:
    """Counter rows (COUNTERS order) summed into {name: value}."""
    total = [0] * len(COUNTERS)
    for row in rows:
        for i, value in enumerate(row):
            total[i] += value
    return dict(zip(COUNTERS, total, strict=True))


class BadCopyError(OSError):
    """--verify-served: an extent of the staged copy failed its checksum before it was
    served (an OSError: the copy's fault, so it is evicted as an unreadable one is)."""

    def __init__(self, ext: int) -> None:
        super().__init__(f"extent {ext} fails its checksum (checked before serving it)")


def _pread_exact(fd: int, length: int, pos: int) -> bytes:
    data = os.pread(fd, length, pos)
    if len(data) != length:
        raise OSError(f"the staged copy ends {length - len(data)} bytes early")
    return data


def _address(address) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

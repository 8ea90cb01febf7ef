"""The order socket: samplers register their paths and announce each epoch's order.

Served by the control process next to the trace socket (dlfsd.obs.controlsock
calls `handle` for each connection; one at a time, each message bounded by
REQUEST_TIMEOUT). The wire format is dlfs.order.wire. A request the
daemon cannot take is answered with one line saying why; a client that breaks
the protocol is disconnected. Only root, the daemon's user and the mount's
`--uid` user are answered.

What a client can make the daemon hold is bounded before it is read: one
connection is answered at a time, each message must arrive whole within
REQUEST_TIMEOUT, and a body over its request's limit (`body_limit`: a
registration at most PATH_BYTES per entry of the mount and MAX_REGISTER_BODY, an
announcement 4 bytes per registered sample) is refused in one line without being
read; the look-ahead bounds what it keeps across clients (dlfsd.core.lookahead).

The socket's abstract name is drawn at random when the service is made (before
the workers fork) and published, once bound, in shared memory that the workers
render as `.dlfs/order`: a name another user bound first is never ours, and a
client learns ours only from the mount itself (dlfs.order.wire).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import socket
import struct

import numpy as np

from dlfs.errors import DlfsError
from dlfs.order.wire import (
    ORDER_FILE,
    BodyRefused,
    OrderWireError,
    new_socket_name,
    recv_message,
    send_message,
)
from dlfs.sizes import format_size
from dlfsd.core.lookahead import LookAhead, unknown_registration

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 30.0  # per message: a client that stops mid-message is dropped
MAX_REGISTER_BODY = 64 << 20  # ImageNet's 1.28 M paths take ~60 MiB
MIN_REGISTER_BODY = 64 << 10  # a tiny mount still takes a few long paths
PATH_BYTES = 256  # per entry of the mount: far above any real path's length
BIND_TRIES = 3  # fresh names tried when one is taken (a collision: someone read ours)
_NAME_ROOM = 128  # bytes of the shared page holding the bound name


class OrderService:
    """The listening socket and its request handler (bound in the main process)."""

    def __init__(self, mountpoint: str, lookahead: LookAhead, mount_uid: int | None) -> None:
        self.mountpoint = mountpoint
        self.name = new_socket_name(mountpoint)
        self.lookahead = lookahead
        self.allowed = {0, os.getuid()} | ({mount_uid} if mount_uid is not None else set())
        self.sock: socket.socket | None = None
        entries = sum(int(r.directory.arrays["mode"].size) for r in lookahead.ns.readers)
        self.register_limit = min(MAX_REGISTER_BODY,
                                  max(MIN_REGISTER_BODY, PATH_BYTES * entries))
        self.max_paths = 2 * entries + 1024  # a list naming every file twice, and more
        # The bound name, for `.dlfs/order` (rendered by the workers, forked before the
        # socket is bound): empty until then, and if no name could be bound.
        self._published = mmap.mmap(-1, _NAME_ROOM)
        lookahead.ns.observe.control.add(ORDER_FILE.encode(), self.render)

    def render(self) -> bytes:
        """`.dlfs/order`: the socket's abstract name (without its NUL) and a newline;
        empty while it does not listen."""
        name = bytes(self._published).rstrip(b"\0")
        return name + b"\n" if name else b""

    def listen(self) -> bool:
        """Bind the abstract socket under a fresh name; False (logged) if none could be
        bound. A name already bound is never shared: another is drawn."""
        for _ in range(BIND_TRIES):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.bind(self.name)
                sock.listen(16)
            except OSError as err:
                sock.close()
                log.error("order socket @%s: cannot listen: %s%s", self.name[1:].decode(),
                          err.strerror or err, "; trying a fresh name"
                          if err.errno == errno.EADDRINUSE else "")
                if err.errno != errno.EADDRINUSE:
                    break
                self.name = new_socket_name(self.mountpoint)
                continue
            self.sock = sock
            self._published[:len(self.name) - 1] = self.name[1:]
            return True
        log.error("no look-ahead (no order socket could be bound)")
        return False

    def start(self) -> None:
        """In the control process: start following announcements."""
        self.lookahead.start()

    def stop(self) -> None:
        self.lookahead.stop()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def handle(self, conn: socket.socket) -> None:
        """Answer requests on `conn` until the client closes it."""
        conn.settimeout(REQUEST_TIMEOUT)
        if _peer_uid(conn) not in self.allowed:
            send_message(conn, {"ok": False, "error": "permission denied: only root, the "
                                "mount's owner and its --uid user announce orders"})
            return
        pending = bytearray()
        while True:
            try:
                header, body = recv_message(conn, pending, self.body_limit, REQUEST_TIMEOUT)
            except BodyRefused as err:  # its body was not read: the connection ends here
                log.warning("order socket: %s", err)
                send_message(conn, {"ok": False, "error": str(err)})
                return
            except OrderWireError as err:
                if str(err) != "connection closed":
                    log.warning("order socket: %s; client dropped", err)
                return
            try:
                reply, data = self._answer(header, body)
            except DlfsError as err:
                reply, data = {"ok": False, "error": str(err)}, b""
            send_message(conn, reply, data)

    def body_limit(self, header: dict, size: int) -> str | None:
        """None if a request with `header` may carry `size` body bytes, else the one
        line refusing it (said before the body is read, so nothing of it is held)."""
        op = header.get("op")
        if op == "register":
            if size <= self.register_limit:
                return None
            return (f"a registration of {size} bytes of paths is over this mount's limit "
                    f"of {format_size(self.register_limit)} ({PATH_BYTES} B per entry of "
                    f"the mount, at most {format_size(MAX_REGISTER_BODY)}): register only "
                    f"paths of files in {self.mountpoint}, each once")
        if op == "announce":
            samples = self.lookahead.registered_samples(header.get("handle"))
            if samples is None:
                return unknown_registration(header.get("handle"))
            if size <= 4 * samples:
                return None
            return (f"an announcement of {size // 4} samples is longer than its "
                    f"registration's {samples} samples: announce each reader's share "
                    "of one epoch (at most one index per registered sample)")
        return None if size == 0 else f"request {op!r} takes no body"

    def _answer(self, header: dict, body: bytes) -> tuple[dict, bytes]:
        op = header.get("op")
        if op == "register":
            return self._register(body)
        if op == "announce":
            return self._announce(header, body)
        if op == "status":
            return {"ok": True, **self.lookahead.status()}, b""
        raise DlfsError(f"unknown request {op!r} (register, announce, status)")

    def _register(self, body: bytes) -> tuple[dict, bytes]:
        paths = body.count(b"\n") + 1 if body else 0
        if paths > self.max_paths:
            raise DlfsError(f"a registration of {paths} paths is over this mount's limit "
                            f"of {self.max_paths} (two per entry of the mount): register "
                            f"only paths of files in {self.mountpoint}")
        digest = hashlib.blake2b(body, digest_size=16).digest()
        again = self.lookahead.register_again(digest)
        if again is None:
            handle, registration = self.lookahead.register(
                body.split(b"\n") if body else [], digest)
        else:
            handle, registration = again
        keys, nodes, node_count, node = self.lookahead.locality(registration)
        samples = registration.rows.size
        unknown = int((registration.rows < 0).sum())
        log.info("look-ahead: registration %d, %d paths (%d not files of this mount)%s",
                 handle, samples, unknown, "" if again is None else ", resolved before")
        reply = {"ok": True, "handle": handle, "node": node, "node_count": node_count,
                 "samples": samples, "chunks": int(nodes.size), "unknown": unknown}
        return reply, keys.astype("<i8").tobytes() + nodes.astype("<i4").tobytes()

    def _announce(self, header: dict, body: bytes) -> tuple[dict, bytes]:
        handle, epoch = header.get("handle"), header.get("epoch")
        if not isinstance(handle, int) or not isinstance(epoch, int) or len(body) % 4:
            raise DlfsError("announce needs an integer handle and epoch and int32 indices")
        order = np.frombuffer(body, "<i4")
        samples = self.lookahead.announce(handle, epoch, order)
        return {"ok": True, "samples": samples}, b""


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]

"""The order socket: samplers register their paths and announce each epoch's order.

Served by the control process next to the trace socket (dlfsd.obs.controlsock
calls `handle` for each connection; one at a time, each bounded by
REQUEST_TIMEOUT per receive). The wire format is dlfs.orderwire. A request the
daemon cannot take is answered with one line saying why; a client that breaks
the protocol is disconnected. Only root, the daemon's user and the mount's
`--uid` user are answered.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct

import numpy as np

from dlfs.errors import DlfsError
from dlfs.orderwire import OrderWireError, recv_message, send_message, socket_name
from dlfsd.lookahead import LookAhead

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 30.0  # per receive: a client that stops mid-message is dropped


class OrderService:
    """The listening socket and its request handler (bound in the main process)."""

    def __init__(self, mountpoint: str, lookahead: LookAhead, mount_uid: int | None) -> None:
        self.name = socket_name(mountpoint)
        self.lookahead = lookahead
        self.allowed = {0, os.getuid()} | ({mount_uid} if mount_uid is not None else set())
        self.sock: socket.socket | None = None

    def listen(self) -> bool:
        """Bind the abstract socket; False (logged) if another daemon holds the name."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.name)
            sock.listen(16)
        except OSError as err:
            sock.close()
            log.error("no look-ahead (cannot listen on the order socket: %s)",
                      err.strerror or err)
            return False
        self.sock = sock
        return True

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
                header, body = recv_message(conn, pending)
            except OrderWireError as err:
                if str(err) != "connection closed":
                    log.warning("order socket: %s; client dropped", err)
                return
            try:
                reply, data = self._answer(header, body)
            except DlfsError as err:
                reply, data = {"ok": False, "error": str(err)}, b""
            send_message(conn, reply, data)

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

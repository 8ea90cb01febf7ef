"""The order socket's wire format: how a sampler tells a node's daemon what comes next.

Both ends import this module: the sampler's client (dlfs.order.client) and the
daemon's look-ahead (dlfsd.core.lookahead). A message is one JSON line, then
exactly `body` raw bytes when the line names a body. The client sends a
request, the daemon answers one message; a connection may carry several.

Requests:
  {"op": "register", "body": n}   body: the sample paths, relative to the
      mountpoint, separated by b"\\n". Answer: {"ok", "handle", "node",
      "node_count", "samples", "chunks", "unknown", "body"}, body: int64
      per sample (its chunk key, -1: not a file of this mount), then int32
      per chunk key (the node whose copy readers on it use first; -1: none).
  {"op": "announce", "handle": h, "epoch": e, "body": 4 * m}   body: int32
      sample indices (into the registered paths) in the order one reader will
      read them this epoch. Answer: {"ok", "samples"}.
  {"op": "status"}   Answer: {"ok", "streams", "counters"}.
Errors: {"ok": false, "error": "one line"}.

The socket lives in the abstract namespace (no file, so no directory
permissions): a mount made by root for a user (Slurm prolog, --uid) is
reachable by that user's training processes; the daemon admits root, its own
user and the mount's --uid user only (SO_PEERCRED). Anyone may bind an abstract
name, so the name is not derived from the mountpoint: the daemon draws it at
random (`new_socket_name`) and serves it in its own mount as `.dlfs/order`
(ORDER_FILE), which only that daemon can answer; the client also checks that
root or its own user holds the socket (SO_PEERCRED), see docs/ORDER.md.

A body larger than the receiver allows for that request (`limit`) is refused
before a byte of it is read: the daemon answers one line and closes the
connection (the client finds the line after its send fails).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time
from collections.abc import Callable

PROTOCOL_VERSION = 1
MAX_LINE = 4096
MAX_BODY = 1 << 31  # what a client takes from its daemon (answers: 12 B per sample)
ORDER_FILE = "order"  # in the mount's `.dlfs/`: the socket's name, one line
NAME_PREFIX = b"dlfs-order-"


class OrderWireError(Exception):
    """The other end broke the protocol or went away mid-message."""


class BodyRefused(OrderWireError):
    """A message announced a body the receiver does not take; str() is the one line
    to answer with (the body was not read: the connection cannot go on)."""


def new_socket_name(mountpoint: str) -> bytes:
    """A fresh abstract socket address for the daemon serving `mountpoint`: the
    mountpoint's key (for people reading /proc/net/unix) and 128 random bits, so no
    other user can bind it before the daemon does."""
    key = hashlib.sha1(os.fsencode(mountpoint)).hexdigest()[:16]
    return b"\0" + NAME_PREFIX + f"{key}-{secrets.token_hex(16)}".encode()


def valid_socket_name(name: bytes) -> bool:
    """`name` (without its leading NUL) is one `new_socket_name` makes."""
    return (name.startswith(NAME_PREFIX) and len(name) < 108
            and all(c in b"0123456789abcdef-" for c in name[len(NAME_PREFIX):]))


def send_message(sock: socket.socket, header: dict, body: bytes | memoryview = b"") -> None:
    """One JSON line, then the body (its length goes into the line as "body")."""
    if body:
        header = {**header, "body": len(body)}
    sock.sendall(json.dumps(header).encode() + b"\n")
    if body:
        sock.sendall(body)


def recv_message(sock: socket.socket, pending: bytearray,
                 limit: Callable[[dict, int], str | None] | None = None,
                 timeout: float | None = None) -> tuple[dict, bytes]:
    """The next message: (header, body). `pending` keeps bytes read past it.

    `limit(header, size)`: None to take a body of `size` bytes, else why not (raised
    as BodyRefused before the body is read or allocated). `timeout`: the whole
    message must arrive within it (a client sending a byte now and then cannot hold
    the daemon's control process for longer)."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def recv(n: int) -> bytes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OrderWireError(f"message not complete within {timeout:.0f} s")
            sock.settimeout(left)
        return sock.recv(n)

    while b"\n" not in pending:
        if len(pending) > MAX_LINE:
            raise OrderWireError("message line too long")
        data = recv(65536)
        if not data:
            raise OrderWireError("connection closed")
        pending += data
    line, _, rest = bytes(pending).partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        raise OrderWireError("message line is not JSON") from None
    if not isinstance(header, dict):
        raise OrderWireError("message line is not a JSON object")
    size = header.get("body", 0)
    if not isinstance(size, int) or not 0 <= size <= MAX_BODY:
        raise OrderWireError(f"bad body length {size!r}")
    if limit is not None:
        why = limit(header, size)
        if why is not None:
            raise BodyRefused(why)
    body = bytearray(rest[:size])
    while len(body) < size:
        data = recv(min(1 << 20, size - len(body)))
        if not data:
            raise OrderWireError("connection closed inside a message body")
        body += data
    pending[:] = rest[size:]
    return header, bytes(body)

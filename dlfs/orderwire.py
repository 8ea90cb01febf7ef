"""The order socket's wire format: how a sampler tells a node's daemon what comes next.

Both ends import this module: the sampler's client (dlfs.orderclient) and the
daemon's look-ahead (dlfsd.lookahead). A message is one JSON line, then
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
user and the mount's --uid user only (SO_PEERCRED).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket

PROTOCOL_VERSION = 1
MAX_LINE = 4096
MAX_BODY = 1 << 31  # 2 GiB of paths or order: far beyond any dataset of today


class OrderWireError(Exception):
    """The other end broke the protocol or went away mid-message."""


def socket_name(mountpoint: str) -> bytes:
    """The abstract socket address of the daemon serving canonical path `mountpoint`."""
    key = hashlib.sha1(os.fsencode(mountpoint)).hexdigest()[:16]
    return b"\0dlfs-order-" + key.encode()


def send_message(sock: socket.socket, header: dict, body: bytes | memoryview = b"") -> None:
    """One JSON line, then the body (its length goes into the line as "body")."""
    if body:
        header = {**header, "body": len(body)}
    sock.sendall(json.dumps(header).encode() + b"\n")
    if body:
        sock.sendall(body)


def recv_message(sock: socket.socket, pending: bytearray) -> tuple[dict, bytes]:
    """The next message: (header, body). `pending` keeps bytes read past it."""
    while b"\n" not in pending:
        if len(pending) > MAX_LINE:
            raise OrderWireError("message line too long")
        data = sock.recv(65536)
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
    body = bytearray(rest)
    while len(body) < size:
        data = sock.recv(min(1 << 20, size - len(body)))
        if not data:
            raise OrderWireError("connection closed inside a message body")
        body += data
    pending[:] = body[size:]
    return header, bytes(body[:size])

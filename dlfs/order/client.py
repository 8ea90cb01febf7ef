"""The sampler's side of the order socket: find the DLFS mount, register, announce.

`connect(paths)` returns None (and says why, via `why_not`) when the paths are
not under a DLFS mount or its daemon does not listen: the sampler then works
as a plain sampler. Each call opens its own short connection, so a sampler
never holds the daemon's control process, and a forked DataLoader worker
never shares a socket with its parent.

Whom it talks to: the socket named in the mount's own `.dlfs/order` (only the
mount's daemon answers reads there), and only if root or this process's user
holds it (SO_PEERCRED): another user who bound some abstract name cannot feed
a sampler (docs/ORDER.md).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Sequence

import numpy as np

from dlfs.mountinfo import mountpoints_of_type
from dlfs.order.seam import Locality
from dlfs.order.wire import (
    ORDER_FILE,
    OrderWireError,
    recv_message,
    send_message,
    valid_socket_name,
)

CONNECT_TIMEOUT = 10.0
#: Registering a million paths makes the daemon look each one up: give it time.
REGISTER_TIMEOUT = 600.0
DLFS_FSTYPE = "fuse.dlfs"


class OrderClientError(RuntimeError):
    """The daemon refused a request or could not be reached (one line: what and why)."""


def mount_of(path: str, mounts: Sequence[str]) -> str | None:
    """The deepest mountpoint in `mounts` that contains `path` (absolute, not resolved)."""
    path = os.path.abspath(path)
    best = None
    for mount in mounts:
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) \
                and (best is None or len(mount) > len(best)):
            best = mount
    return best


def socket_of(mountpoint: str) -> bytes:
    """The order socket's abstract address, as the mount's daemon serves it in
    MOUNTPOINT/.dlfs/order (OrderClientError if it serves none)."""
    path = os.path.join(mountpoint, ".dlfs", ORDER_FILE)
    try:
        with open(path, "rb") as f:
            name = f.read(256).strip()
    except OSError as err:
        raise OrderClientError(f"no DLFS daemon answers for {mountpoint} ({path}: "
                               f"{err.strerror}); is it mounted with look-ahead on?") from None
    if not name:
        raise OrderClientError(f"no DLFS daemon answers for {mountpoint} (its order socket "
                               "is not listening: see the daemon's log)")
    if not valid_socket_name(name):
        raise OrderClientError(f"{path} names no order socket ({name[:40]!r})")
    return b"\0" + name


def check_server(sock: socket.socket, mountpoint: str) -> None:
    """Refuse a socket held by anyone but root or this process's user: whoever holds it
    would steer what the daemon of `mountpoint` reads ahead (and what the sampler is
    told about the mount)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid not in (0, os.getuid()):
        raise OrderClientError(
            f"the order socket for {mountpoint} is held by uid {uid} (pid {pid}), neither "
            f"root nor you (uid {os.getuid()}): not using it; remount, and tell the "
            "administrator")


class OrderClient:
    """Registered paths of one sampler at one mount's daemon."""

    def __init__(self, mountpoint: str, paths: Sequence[str],
                 socket_name: bytes | None = None) -> None:
        """`socket_name`: the abstract address to use instead of the one the mount
        serves (tests of whom the client accepts)."""
        self.mountpoint = mountpoint
        self.name = socket_of(mountpoint) if socket_name is None else socket_name
        relative = [os.fsencode(os.path.relpath(os.path.abspath(p), mountpoint)) for p in paths]
        header, body = self._ask({"op": "register"}, b"\n".join(relative), REGISTER_TIMEOUT)
        count, chunks = int(header["samples"]), int(header["chunks"])
        if count != len(paths) or len(body) != 8 * count + 4 * chunks:
            raise OrderClientError(f"the daemon of {mountpoint} answered a register of "
                                   f"{len(paths)} paths with {count}")
        self.handle = int(header["handle"])
        self.unknown = int(header["unknown"])
        self._locality = Locality(
            np.frombuffer(body, "<i8", count).astype(np.int64),
            np.frombuffer(body, "<i4", chunks, 8 * count).astype(np.int32),
            int(header["node_count"]), int(header["node"]))

    def locality(self) -> Locality:
        return self._locality

    def announce(self, epoch: int, order: np.ndarray) -> None:
        """Tell the daemon the order this reader takes the samples in this epoch."""
        body = np.ascontiguousarray(order, dtype="<i4").tobytes()
        self._ask({"op": "announce", "handle": self.handle, "epoch": int(epoch)}, body,
                  CONNECT_TIMEOUT)

    def status(self) -> dict:
        return self._ask({"op": "status"}, b"", CONNECT_TIMEOUT)[0]

    def close(self) -> None:
        pass  # nothing held between calls

    def _ask(self, header: dict, body: bytes, timeout: float) -> tuple[dict, bytes]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            try:
                sock.connect(self.name)
            except OSError as err:
                raise OrderClientError(f"no DLFS daemon answers for {self.mountpoint} "
                                       f"({err.strerror}); is it mounted with look-ahead "
                                       f"on?") from None
            check_server(sock, self.mountpoint)
            try:
                # A body refused before it was read ends the send early; the daemon's
                # one line saying why is waiting to be read.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    send_message(sock, header, body)
                reply, data = recv_message(sock, bytearray())
            except (OSError, OrderWireError) as err:
                raise OrderClientError(f"the DLFS daemon of {self.mountpoint} did not "
                                       f"answer {header['op']}: {err}") from None
        finally:
            sock.close()
        if not reply.get("ok"):
            raise OrderClientError(f"the DLFS daemon of {self.mountpoint} refused "
                                   f"{header['op']}: {reply.get('error', 'no reason given')}")
        return reply, data


def connect(paths: Sequence[str], mount: str | None = None) -> OrderClient | None:
    """A client for the DLFS mount holding `paths` (or `mount`); None if there is none.

    Raises OrderClientError when there is a DLFS mount but its daemon refuses or
    does not answer (the sampler logs it once and goes on as a plain sampler).
    """
    if not paths:
        return None
    mounts = mountpoints_of_type(DLFS_FSTYPE)
    if mount is not None:
        mount = os.path.abspath(mount)
        if mount not in mounts:
            raise OrderClientError(f"{mount} is not a DLFS mountpoint")
    else:
        mount = mount_of(os.fspath(paths[0]), mounts)
        if mount is None:
            return None
    return OrderClient(mount, [os.fspath(p) for p in paths])

"""WireSide: a WireWorker (the daemon's FUSE adapter) in this process, fed raw kernel
requests, its replies read back through a socket pair standing in for /dev/fuse.

No mount and no kernel: the requests are built with the same layouts
(dlfsd.fuse.fusewire) the kernel's have, so the worker's whole dispatch,
errno boundary and reply packing run as in a daemon.
"""

from __future__ import annotations

import os
import socket

from dlfsd.base.kernel import KERNEL_RELEASE_VAR
from dlfsd.core.namespace import Namespace
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse.wireworker import WireWorker


class WireSide:
    """Answers from a WireWorker built as on a kernel that sends OPEN and OPENDIR (it
    answers them, and so every request gets a real answer)."""

    def __init__(self, ns: Namespace, monkeypatch) -> None:
        monkeypatch.setenv(KERNEL_RELEASE_VAR, "3.10.0")  # sends OPEN and OPENDIR always
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.worker = WireWorker(ns, theirs.fileno(), 0, 0, 1.0, count_opens=True)
        self._theirs = theirs
        self.unique = 0

    def close(self) -> None:
        self.ours.close()
        self._theirs.close()

    def ask(self, opcode: int, ino: int, payload: bytes = b"") -> tuple[int, bytes]:
        """(errno, reply payload) of one request about `ino`."""
        self.unique += 1
        head = fw.IN_HEADER.pack(fw.IN_HEADER.size + len(payload), opcode, self.unique, ino,
                                 0, 0, os.getpid(), 0, 0)
        request = head + payload
        self.worker._buf[: len(request)] = request
        self.worker._dispatch(len(request))
        reply = self.ours.recv(1 << 20)
        _, error, unique = fw.OUT_HEADER.unpack_from(reply)
        assert unique == self.unique
        return -error, reply[fw.OUT_HEADER.size :]

    def read(self, ino: int, fh: int, offset: int, size: int) -> tuple[int, bytes]:
        """A READ through handle `fh` (0: a file the kernel opened alone, no_open)."""
        return self.ask(fw.READ, ino, fw.READ_IN.pack(fh, offset, size, 0) + bytes(16))

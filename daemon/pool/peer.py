"""The errors every read from a peer daemon raises.

A daemon reads byte ranges of the chunks other daemons have staged on their
local NVMe. The server side is dlfsd.pool.peerserver (PeerLoopServer), the
client dlfsd.pool.peersync (BlockingPeerClient), the wire format and its
validity rules dlfsd.pool.protocol (docs/PROTOCOL.md). The callers (the chunk
pool, the stager, replication) catch these without importing either end and
decide by the class (ChunkPool: a PeerMiss only means "not staged there", the
others mark the peer down).
"""

from __future__ import annotations

from dlfs.errors import DlfsError


class PeerError(DlfsError):
    """A read from a peer daemon did not return the bytes."""


class PeerUnavailable(PeerError):
    """The peer cannot be used now (down, silent, wrong secret, broken connection).

    The caller should mark the peer down and read from a replica or the store.
    """


class PeerUnreachable(PeerUnavailable):
    """No connection could be made (refused, no route): nothing listens there, maybe
    not yet (a job's daemons start one by one)."""


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

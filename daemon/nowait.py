"""Reads that never wait for the disk: preadv(RWF_NOWAIT) of what the page cache holds.

The reader (a cached extent served inline, no thread hop) and the peer server
(a cached range answered at once, the rest handed to disk threads) both need
it; it lives below both so the pool does not import the reader.
"""

from __future__ import annotations

import os

HAVE_NOWAIT = hasattr(os, "RWF_NOWAIT") and hasattr(os, "preadv")


def pread_nowait(fd: int, length: int, pos: int) -> bytearray | None:
    """The bytes if all are in the page cache (never blocks), else None.

    Raises OSError (EOPNOTSUPP, EINVAL) where the file system cannot do RWF_NOWAIT.
    """
    if not HAVE_NOWAIT:
        return None
    buf = bytearray(length)
    return buf if read_cached_into(fd, buf, pos) else None


def read_cached_into(fd: int, buf, pos: int) -> bool:
    """Fill `buf` from the page cache without blocking; False if not all of it is there.

    Raises OSError (EOPNOTSUPP, EINVAL) where the file system cannot do RWF_NOWAIT.
    """
    try:
        return os.preadv(fd, [buf], pos, os.RWF_NOWAIT) == len(buf)
    except BlockingIOError:
        return False

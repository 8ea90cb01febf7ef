"""Reads that never wait for the disk: preadv(RWF_NOWAIT) of what the page cache holds.

The peer server answers a cached range at once and hands the rest to its disk
threads. (The single-process mode's reader used it too, to stay in its trio
loop on a page-cache hit; the worker processes just read, blocking.)
"""

from __future__ import annotations

import os

HAVE_NOWAIT = hasattr(os, "RWF_NOWAIT") and hasattr(os, "preadv")


def read_cached_into(fd: int, buf, pos: int) -> bool:
    """Fill `buf` from the page cache without blocking; False if not all of it is there.

    Raises OSError (EOPNOTSUPP, EINVAL) where the file system cannot do RWF_NOWAIT.
    """
    try:
        return os.preadv(fd, [buf], pos, os.RWF_NOWAIT) == len(buf)
    except BlockingIOError:
        return False

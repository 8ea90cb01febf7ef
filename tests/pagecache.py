"""Page-cache residency of a file, asked of the kernel (mincore), for tests.

Used to tell "the daemon was asked again" from "the kernel dropped the pages
meanwhile" (this VM runs a DAMON pageout scheme that can evict fresh pages).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@contextlib.contextmanager
def pinned(fd: int) -> Iterator[None]:
    """Keep every page of an open file in the page cache for the block (mmap + mlock:
    reclaim, this VM's DAMON pageout included, skips locked pages). Pages not cached are
    read first, through the file system, as a read would."""
    size = os.fstat(fd).st_size
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        assert _libc.mlock(addr, size) == 0, os.strerror(ctypes.get_errno())
        try:
            yield
        finally:
            _libc.munlock(addr, size)
    finally:
        _libc.munmap(addr, size)


def resident(path: Path, start: int = 0, end: int | None = None) -> bool:
    """Every page of path[start:end] is in the page cache (mincore; reads nothing, unlike
    a RWF_NOWAIT read, which starts read-ahead on a miss)."""
    return not missing_pages(path, start, end)


def missing_pages(path: Path, start: int = 0, end: int | None = None) -> list[int]:
    """Page numbers of path[start:end] that are not in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return missing_pages_fd(fd, start, end)
    finally:
        os.close(fd)


def missing_pages_fd(fd: int, start: int = 0, end: int | None = None) -> list[int]:
    """missing_pages of an open file (opening a FUSE file may itself be counted)."""
    size = os.fstat(fd).st_size
    end = size if end is None else end
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        pages = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        assert _libc.mincore(addr, size, pages) == 0, os.strerror(ctypes.get_errno())
    finally:
        _libc.munmap(addr, size)
    first = start // mmap.PAGESIZE
    wanted = pages.raw[first : (end + mmap.PAGESIZE - 1) // mmap.PAGESIZE]
    return [first + i for i, flag in enumerate(wanted) if not flag & 1]

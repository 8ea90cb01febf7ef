"""Page-cache residency of files, and what the file system under a test can do, for tests.

Residency is asked of the kernel with mincore(2) on a mapping of the file. Used
to tell "the daemon was asked again" from "the kernel dropped the pages
meanwhile" (this VM runs a DAMON pageout scheme that can evict fresh pages).
mincore sees the right pages on overlayfs too: a mapping of an overlay file is
a mapping of the file beneath it, which holds the pages. Calls that go by the
file descriptor do not: cachestat(2) of an overlay file sees an empty cache,
and preadv(RWF_NOWAIT) fails with EOPNOTSUPP.

Feature probes live here, once, not in each test: `require(directory,
feature, ...)` skips the test with a reason naming the file system where a
feature is missing (FEATURES lists them; each is probed once per file system
with a small file of its own). The daemon falls back where RWF_NOWAIT or
copy_file_range are missing and the tests check the bytes it serves either way
(tests/test_overlay.py mounts on a file system that lacks RWF_NOWAIT); only a
test that counts which reads the page cache answered needs "nowait read".
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = mmap.PAGESIZE


# -- residency --------------------------------------------------------------------------
@contextlib.contextmanager
def pinned(fd: int) -> Iterator[None]:
    """Keep every page of an open file in the page cache for the block (mmap + mlock:
    reclaim, this VM's DAMON pageout included, skips locked pages). Pages not cached are
    read first, through the file system, as a read would."""
    size = os.fstat(fd).st_size
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, _MAP_FAILED), os.strerror(ctypes.get_errno())
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
    assert addr not in (None, _MAP_FAILED), os.strerror(ctypes.get_errno())
    try:
        pages = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
        assert _libc.mincore(addr, size, pages) == 0, os.strerror(ctypes.get_errno())
    finally:
        _libc.munmap(addr, size)
    first = start // PAGE
    wanted = pages.raw[first : (end + PAGE - 1) // PAGE]
    return [first + i for i, flag in enumerate(wanted) if not flag & 1]


def drop_pages(paths: Iterable[Path]) -> None:
    """Write the files' dirty pages back and drop them all from the page cache (clean
    pages only go: hence the fsync). Also forgets that reclaim evicted any of them
    (see evicted_pages). Where that is impossible, require(..., "page residency")
    has skipped the test already."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class ResidencyWatch:
    """Which pages of some files were in the page cache at any moment while it ran.

    A thread asks mincore every `interval` seconds. Asking now and then, a test
    misses a page that was read and evicted again in between (this VM's DAMON
    pageout evicts fresh pages in bulk, seconds apart): start the watch before the
    reads that cache them, and ask `never_cached`, which also counts the pages
    reclaim evicted meanwhile where the kernel can tell (evicted_pages).
    """

    def __init__(self, paths: Iterable[Path], interval: float = 0.002) -> None:
        self.interval = interval
        self._maps = []
        self._seen: dict[Path, np.ndarray] = {}
        for path in paths:
            size = os.path.getsize(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            finally:
                os.close(fd)  # the mapping keeps the file
            assert addr not in (None, _MAP_FAILED), os.strerror(ctypes.get_errno())
            vector = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            self._maps.append((path, addr, size, vector))
            self._seen[path] = np.zeros(len(vector), dtype=bool)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="residency-watch", daemon=True)

    def __enter__(self) -> ResidencyWatch:
        self.poll()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for _, addr, size, _ in self._maps:
            _libc.munmap(addr, size)
        self._maps = []

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        """Look once (the thread does this every `interval`)."""
        with self._lock:
            for path, addr, size, vector in self._maps:
                assert _libc.mincore(addr, size, vector) == 0, os.strerror(ctypes.get_errno())
                self._seen[path] |= np.frombuffer(vector.raw, dtype=np.uint8) & 1 == 1

    def was_cached(self, path: Path, start: int = 0, end: int | None = None) -> np.ndarray:
        """Per page of path[start:end]: seen in the page cache, or evicted by reclaim since
        it was dropped (drop_pages; where the kernel can tell, see evicted_pages)."""
        self.poll()
        with self._lock:
            seen = self._seen[path]
            first = start // PAGE
            cached = seen[first : len(seen) if end is None else (end + PAGE - 1) // PAGE].copy()
        missing = np.flatnonzero(~cached)
        for page in evicted_pages(path, (int(p) + first for p in missing)):
            cached[page - first] = True
        return cached

    def never_cached(self, path: Path, start: int = 0, end: int | None = None) -> list[int]:
        """Page numbers of path[start:end] never in the page cache since the watch began."""
        first = start // PAGE
        return [int(p) + first for p in np.flatnonzero(~self.was_cached(path, start, end))]

    def ever_cached(self, path: Path, start: int = 0, end: int | None = None) -> list[int]:
        """Page numbers of path[start:end] in the page cache at some point."""
        first = start // PAGE
        return [int(p) + first for p in np.flatnonzero(self.was_cached(path, start, end))]


# -- cachestat (Linux >= 6.5) -----------------------------------------------------------
_SYS_CACHESTAT = 451  # same number on every architecture


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class Cachestat(ctypes.Structure):
    """struct cachestat: page counts of a file range (cached, dirty, under writeback,
    evicted by reclaim and remembered, of those recently)."""

    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def cachestat(fd: int, start: int = 0, length: int = 0) -> Cachestat:
    """The kernel's page counts of fd[start:start+length] (length 0: to the end).
    OSError where the kernel has no cachestat (ENOSYS); see require(..., "cachestat")
    for file systems where it sees nothing."""
    rng, stat = _CachestatRange(start, length), Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(stat), 0):
        err = ctypes.get_errno()
        raise OSError(err, f"cachestat: {os.strerror(err)}")
    return stat


def evicted_pages(path: Path, pages: Iterable[int]) -> set[int]:
    """Those of `pages` that reclaim evicted from the page cache since drop_pages (the
    kernel keeps a shadow entry where an evicted page was; dropping clears them).
    Empty where cachestat cannot tell (no cachestat, or a file system where it sees no
    page cache, like overlayfs)."""
    pages = list(pages)
    if not pages or missing_feature(Path(path).parent, "cachestat"):
        return set()
    fd = os.open(path, os.O_RDONLY)
    try:
        if not cachestat(fd).nr_evicted:  # the usual case: no need to ask page by page
            return set()
        return {p for p in pages if cachestat(fd, p * PAGE, PAGE).nr_evicted}
    finally:
        os.close(fd)


# -- what the file system can do --------------------------------------------------------
FEATURES = {
    "page residency": "dropping a file's pages with posix_fadvise(DONTNEED) and seeing "
                      "which are cached with mincore",
    "cachestat": "cachestat(2) of its files' page cache",
    "splice": "splice(2) from its files into a pipe",
    "nowait read": "preadv(RWF_NOWAIT) answered from the page cache",
}
_probed: dict[tuple[int, str], str | None] = {}


def require(directory: Path, *features: str) -> None:
    """Skip the test, saying why, if the file system of `directory` lacks any of
    `features` (keys of FEATURES)."""
    for feature in features:
        reason = missing_feature(directory, feature)
        if reason:
            pytest.skip(reason)


def missing_feature(directory: Path, feature: str) -> str | None:
    """Why the file system of `directory` cannot do `feature`, or None if it can (probed
    once per file system, with a small file of its own in `directory`)."""
    key = (os.stat(directory).st_dev, feature)
    if key not in _probed:
        with tempfile.TemporaryDirectory(dir=directory, prefix=".probe-") as where:
            path = Path(where) / "probe"
            path.write_bytes(os.urandom(64 * PAGE))
            _probed[key] = _PROBES[feature](path)
    why = _probed[key]
    return f"{fs_type(directory)} at {directory} lacks {FEATURES[feature]}: {why}" if why else None


def _probe_residency(path: Path) -> str | None:
    drop_pages([path])
    try:
        left = 64 - len(missing_pages(path))
    except AssertionError as err:  # mmap or mincore refused
        return f"mincore: {err}"
    return f"{left} of 64 clean pages stay cached after DONTNEED" if left else None


def _probe_cachestat(path: Path) -> str | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with pinned(fd):  # cached, and kept so while we ask
            try:
                cached = cachestat(fd).nr_cache
            except OSError as err:
                return f"{err.strerror} (Linux >= 6.5 has it)"
    finally:
        os.close(fd)
    if not cached:
        return "it counts no cached page of a file held in the cache (overlayfs keeps " \
               "the pages on the file beneath)"
    return None


def _probe_splice(path: Path) -> str | None:
    fd = os.open(path, os.O_RDONLY)
    read_end, write_end = os.pipe()
    try:
        os.splice(fd, write_end, PAGE, offset_src=0)
    except OSError as err:
        return f"{errno.errorcode.get(err.errno, err.errno)} ({err.strerror})"
    finally:
        for f in (fd, read_end, write_end):
            os.close(f)
    return None


def _probe_nowait(path: Path) -> str | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with pinned(fd):  # every page cached: a nowait read must not need the disk
            buffer = bytearray(4 * PAGE)
            try:
                got = os.preadv(fd, [buffer], 0, os.RWF_NOWAIT)
            except OSError as err:
                return f"{errno.errorcode.get(err.errno, err.errno)} ({err.strerror})"
    finally:
        os.close(fd)
    return None if got == len(buffer) else f"{got} of {len(buffer)} cached bytes read"


_PROBES = {"page residency": _probe_residency, "cachestat": _probe_cachestat,
           "splice": _probe_splice, "nowait read": _probe_nowait}


def fs_type(path: Path) -> str:
    """The type of the file system `path` is on (the longest mountpoint above it)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown file system"
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            left, _, right = line.partition(b" - ")
            mountpoint = os.fsdecode(re.sub(rb"\\([0-7]{3})",
                                            lambda m: bytes([int(m[1], 8)]),
                                            left.split()[4]))
            inside = real == mountpoint or real.startswith(mountpoint.rstrip("/") + "/")
            if inside and len(mountpoint) >= len(best):
                best, kind = mountpoint, right.split()[0].decode()
    return kind

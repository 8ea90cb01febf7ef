"""SampleReader: file bytes of one dataset, read from its chunk files.

The hot path: a read of cached data is served inline with preadv(RWF_NOWAIT)
and never leaves the trio loop; anything that could block (a disk read, the
first open of a chunk, hashing a large extent) goes to a bounded thread pool,
or runs inline in worker processes (one request at a time each, see dlfsd.main).
Each extent's checksum is checked the first time it is read; concurrent first
reads of one extent share one load. Wrong bytes never leave this class.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from time import perf_counter_ns

import trio

from dlfs.directory import display_path
from dlfs.errors import CorruptDataError, FormatError
from dlfs.format import CHUNK_HEADER_SIZE, check_chunk_header, checksum
from dlfs.store import Dataset
from dlfsd.stats import SOURCE_STORE, NullStats

log = logging.getLogger(__name__)

_HAVE_NOWAIT = hasattr(os, "RWF_NOWAIT") and hasattr(os, "preadv")

UNCHECKED, VERIFIED, CORRUPT = 0, 1, 2


class SampleReader:
    """Reads (row, offset, size) of one dataset; verifies extents on first touch."""

    def __init__(self, dataset: Dataset, limiter: trio.CapacityLimiter, verify: bool = True,
                 inline_io: bool = False):
        self.dataset = dataset
        # inline_io: do blocking I/O right in the handler. Used by worker processes,
        # which serve one request at a time like libfuse's threads (see dlfsd.main).
        self.inline_io = inline_io
        self.directory = dataset.directory
        self._limiter = limiter
        self._fds: list[int] = [-1] * dataset.chunk_count
        # One byte per extent: UNCHECKED, VERIFIED or CORRUPT (already logged). An
        # anonymous shared mapping, so worker processes forked later share it: an
        # extent is verified once per mount and a corrupt one logged once.
        self._state = mmap.mmap(-1, max(1, self.directory.extent_count))
        if not verify:
            self._state.write(bytes([VERIFIED]) * self.directory.extent_count)
        self._loading: dict[int, trio.Event] = {}
        self._unusable_chunks: set[int] = set()  # logged already
        self._nowait = _HAVE_NOWAIT
        d = self.directory
        self._ext_chunk, self._ext_off, self._ext_len = (
            d.ext_chunk_view, d.ext_offset_view, d.ext_length_view)
        self.stats, self.ds = NullStats(), 0  # set by the Namespace: counters, dataset index

    def close(self) -> None:
        self._state.close()
        for i, fd in enumerate(self._fds):
            if fd >= 0:
                os.close(fd)
                self._fds[i] = -1

    async def read(self, row: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        """Up to `size` bytes of file `row` at `offset` (short at end of file)."""
        started = perf_counter_ns()
        data = await self._read_from_store(row, offset, size)
        self.stats.record_source(self.ds, SOURCE_STORE, len(data), perf_counter_ns() - started)
        return data

    async def _read_from_store(self, row: int, offset: int, size: int):
        file_size = self.directory.size(row)
        end = min(offset + size, file_size)
        if offset >= end:
            return b""
        piece = self.directory.extent_size
        base = self.directory.first_extent(row)
        first = offset // piece
        last = (end - 1) // piece
        if first == last:
            return await self._read_extent(base + first, offset - first * piece, end - offset)
        parts = []
        for i in range(first, last + 1):
            lo = max(offset, i * piece) - i * piece
            hi = min(end, (i + 1) * piece) - i * piece
            parts.append(await self._read_extent(base + i, lo, hi - lo))
        return b"".join(parts)

    async def _read_extent(self, ext: int, rel: int, length: int):
        if self._state[ext] != VERIFIED:
            data = await self._load_verified(ext)
            if data is not None:
                return data if rel == 0 and length == len(data) else \
                    memoryview(data)[rel : rel + length]
        fd = await self._fd(self._ext_chunk[ext])
        pos = CHUNK_HEADER_SIZE + self._ext_off[ext] + rel
        if self._nowait and not self.inline_io:  # inline callers may block anyway
            buf = self._pread_cached(fd, length, pos)
            if buf is not None:
                return buf
        return await self._blocking(_pread_exact, fd, length, pos)

    async def _blocking(self, fn, *args):
        """Run a call that may block: inline in worker processes, else in the thread pool."""
        if self.inline_io:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def _pread_cached(self, fd: int, length: int, pos: int) -> bytearray | None:
        """Read without blocking if the bytes are in the page cache, else None."""
        buf = bytearray(length)
        try:
            got = os.preadv(fd, [buf], pos, os.RWF_NOWAIT)
        except BlockingIOError:
            return None
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._nowait = False  # the chunk file system cannot do it; always use threads
            return None
        return buf if got == length else None

    async def _load_verified(self, ext: int) -> bytes | None:
        """Load and check a whole extent once; None if another task checked it meanwhile."""
        while self._state[ext] != VERIFIED:
            pending = self._loading.get(ext)
            if pending is not None:
                await pending.wait()
                continue
            done = self._loading[ext] = trio.Event()
            try:
                fd = await self._fd(self._ext_chunk[ext])
                try:
                    data, digest = await self._blocking(
                        _pread_and_hash, fd, self._ext_len[ext],
                        CHUNK_HEADER_SIZE + self._ext_off[ext])
                except CorruptDataError as err:
                    self._report_corrupt(ext, str(err))
                    raise
                if digest != self.directory.ext_checksum_view[ext]:
                    self._report_corrupt(ext, "checksum mismatch")
                    raise CorruptDataError(f"checksum mismatch in extent {ext}")
                self._state[ext] = VERIFIED
                return data
            finally:
                del self._loading[ext]
                done.set()
        return None

    def _report_corrupt(self, ext: int, what: str) -> None:
        if self._state[ext] == CORRUPT:
            return
        self._state[ext] = CORRUPT
        row = self.directory.row_of_extent(ext)
        log.error("%s: dataset %s, file %s, chunk %d (%s); reads return EIO",
                  what, self.dataset.name, display_path(self.directory.path(row)),
                  self._ext_chunk[ext], self.dataset.chunk_path(self._ext_chunk[ext]))

    async def _fd(self, chunk: int) -> int:
        fd = self._fds[chunk]
        if fd < 0:
            path = self.dataset.chunk_path(chunk)
            try:
                fd = await self._blocking(_open_chunk, path, chunk, self.dataset.uuid)
            except (OSError, FormatError) as err:
                if chunk not in self._unusable_chunks:
                    self._unusable_chunks.add(chunk)
                    log.error("cannot use chunk %d of dataset %s: %s; reads return EIO",
                              chunk, self.dataset.name, err)
                raise CorruptDataError(str(err)) from None
            if self._fds[chunk] >= 0:  # another task opened it meanwhile
                os.close(fd)
                return self._fds[chunk]
            self._fds[chunk] = fd
        return fd


def _pread_exact(fd: int, length: int, pos: int) -> bytes:
    data = os.pread(fd, length, pos)
    if len(data) != length:
        raise CorruptDataError(f"chunk file is truncated at offset {pos}")
    return data


def _pread_and_hash(fd: int, length: int, pos: int) -> tuple[bytes, int]:
    data = _pread_exact(fd, length, pos)
    return data, checksum(data)


def _open_chunk(path, index: int, dataset_uuid: bytes) -> int:
    """Open a chunk file and check its header once (magic, version, owner)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        check_chunk_header(os.pread(fd, CHUNK_HEADER_SIZE, 0), path, index, dataset_uuid)
    except BaseException:
        os.close(fd)
        raise
    return fd

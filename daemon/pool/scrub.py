"""Scrubber: re-check the staged copies in the background, at a bounded rate.

Why: a staged copy is checked when the stager writes it and when this node's
own reader first reads each extent; after that, bit rot (or a file cut short)
in a copy only peers read, or that nobody reads yet, would be found only by a
peer's failed checksum, or never. With `--scrub-rate BYTES/s` the main
process reads every staged copy in turn, a few MiB at a time, compares each
extent with its checksum and evicts and re-stages a bad copy
(ChunkPool.evict_copy), as a reader does with a copy it finds bad.

It reads from the disk where the file system allows (O_DIRECT, through a
second descriptor of the same file): through the page cache it would only
see what an earlier read brought in, not what lies on the NVMe now. The
reads run on a trio worker thread; between them the scrubber sleeps so that
it reads at most `rate` bytes per second on average, next to the stager in
the main process's Services.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from typing import TYPE_CHECKING

import numpy as np
import trio

from dlfs.store.format import CHUNK_HEADER_SIZE, checksum

if TYPE_CHECKING:
    from dlfsd.pool.pool import ChunkPool

log = logging.getLogger(__name__)

BATCH = 8 << 20  # bytes read (and hashed) at a time; an extent is at most 4 MiB
IDLE = 1.0  # seconds between looks while nothing is staged
_ALIGN = 4096  # O_DIRECT offsets and lengths: a multiple of any logical block size


class Scrubber:
    """Reads every staged copy of a ChunkPool again and again, at most `rate` bytes/s."""

    def __init__(self, pool: ChunkPool, rate: int) -> None:
        self.pool = pool
        self.rate = rate
        self.checked_bytes = 0
        self.checked_extents = 0
        self.bad_copies = 0
        self.passes = 0
        self.direct = True  # O_DIRECT worked (False: this file system reads via the cache)
        self._buffer = mmap.mmap(-1, BATCH + 2 * _ALIGN)  # page-aligned, as O_DIRECT wants
        self._due = 0.0

    def counters(self) -> dict:
        return {"rate": self.rate, "checked_bytes": self.checked_bytes,
                "checked_extents": self.checked_extents, "bad_copies": self.bad_copies,
                "passes": self.passes, "direct": self.direct}

    async def run(self) -> None:
        """Scrub until cancelled (unmount): pass after pass over what is staged."""
        try:
            while True:
                if await self._pass():
                    self.passes += 1
                else:
                    await trio.sleep(IDLE)
        finally:
            self._buffer.close()

    async def _pass(self) -> bool:
        """Check every copy staged now, once; False if there was none."""
        any_copy = False
        for ds, cache in enumerate(self.pool.caches):
            for chunk in np.flatnonzero(cache.staged_mask()).tolist():
                any_copy |= await self._scrub_chunk(ds, chunk)
        return any_copy

    async def _scrub_chunk(self, ds: int, chunk: int) -> bool:
        """Check one staged copy, batch by batch; evict it at the first bad extent.
        False if it was not staged (any more)."""
        cache = self.pool.caches[ds]
        fd = await trio.to_thread.run_sync(cache.fd, chunk)  # opening it may block
        if fd < 0:
            return False
        length = int(self.pool.datasets[ds].chunk_lengths[chunk])
        extents = self.pool.extents_in(ds, chunk, 0, length)
        reader = await trio.to_thread.run_sync(self._open_direct, fd)
        try:
            for batch in self._batches(ds, extents):
                bad = await trio.to_thread.run_sync(self._check, ds, reader, fd, batch)
                await self._pace(self._span(ds, batch)[1])
                if bad is not None:
                    self._found_bad(ds, chunk, fd, bad)
                    break
                if cache.cached_fd(chunk) != fd:  # evicted or replaced meanwhile
                    break
        finally:
            if reader != fd:
                os.close(reader)
        return True

    def _batches(self, ds: int, extents: range):
        """Runs of consecutive extents spanning at most BATCH bytes each."""
        d = self.pool.datasets[ds].directory
        batch: list[int] = []
        start = 0
        for ext in extents:
            end = int(d.ext_offset_view[ext]) + int(d.ext_length_view[ext])
            if batch and end - start > BATCH:
                yield batch
                batch = []
            if not batch:
                start = int(d.ext_offset_view[ext])
            batch.append(ext)
        if batch:
            yield batch

    def _open_direct(self, fd: int) -> int:
        """A descriptor of the same file that reads from the disk, or `fd` itself where
        the file system cannot (tmpfs: EINVAL)."""
        if not self.direct:
            return fd
        try:
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as err:
            log.info("scrub reads staged copies through the page cache (O_DIRECT: %s)",
                     err.strerror)
            self.direct = False
            return fd

    def _span(self, ds: int, batch: list[int]) -> tuple[int, int]:
        """(file position, size) of the aligned read that covers a run of extents."""
        d = self.pool.datasets[ds].directory
        first = CHUNK_HEADER_SIZE + int(d.ext_offset_view[batch[0]])
        end = CHUNK_HEADER_SIZE + int(d.ext_offset_view[batch[-1]]) \
            + int(d.ext_length_view[batch[-1]])
        base = first - first % _ALIGN
        return base, -(-(end - base) // _ALIGN) * _ALIGN

    def _check(self, ds: int, reader: int, fd: int, batch: list[int]) -> int | None:
        """In a thread: read a run of extents through `reader` (O_DIRECT, else `fd`),
        check each; the first bad one, else None."""
        d = self.pool.datasets[ds].directory
        base, size = self._span(ds, batch)
        with memoryview(self._buffer)[:size] as view:
            try:
                got = self._read(reader, fd, view, base)
            except OSError:
                return batch[0]  # the disk cannot give them: as bad as wrong bytes
            for ext in batch:
                lo = CHUNK_HEADER_SIZE + int(d.ext_offset_view[ext]) - base
                hi = lo + int(d.ext_length_view[ext])
                if hi > got or checksum(view[lo:hi]) != d.ext_checksum_view[ext]:
                    return ext
                self.checked_extents += 1
                self.checked_bytes += hi - lo
        return None

    def _read(self, reader: int, fd: int, view: memoryview, pos: int) -> int:
        """One read into `view`; a file system that opened the file O_DIRECT but will not
        read it so (EINVAL) is read through the page cache from then on."""
        try:
            return os.preadv(reader, [view], pos)
        except OSError as err:
            if err.errno != errno.EINVAL or reader == fd:
                raise
        log.info("scrub reads staged copies through the page cache (O_DIRECT reads fail "
                 "with EINVAL here)")
        self.direct = False
        return os.preadv(fd, [view], pos)

    def _found_bad(self, ds: int, chunk: int, fd: int, ext: int) -> None:
        if not self.pool.evict_copy(ds, chunk, fd):
            return  # replaced meanwhile: the new copy is checked on its own pass
        self.bad_copies += 1
        log.error("scrub: extent %d of staged chunk %d of dataset %s fails its checksum "
                  "(%s); evicted, staging it again", ext, chunk, self.pool.datasets[ds].name,
                  self.pool.caches[ds].path(chunk))

    async def _pace(self, nbytes: int) -> None:
        """Sleep so that the reads so far took at least nbytes / rate each."""
        now = trio.current_time()
        self._due = max(self._due, now) + nbytes / self.rate
        await trio.sleep_until(self._due)


"""FileCopies: whole-file copies of a dataset's large files on the node, for FUSE passthrough.

Why: a large file (a quarter chunk or more) read through the daemon costs a READ
round trip per MiB and a copy into FUSE's page cache; with FUSE passthrough (Linux
>= 6.9, root) the kernel reads a backing file itself, at the speed of a local file
(bench/large_read.py --cache-dir). But the kernel maps a FUSE file onto one whole
backing file at the same offsets, and a DLFS file lies in extents after a chunk
header, across chunks. So each large file whose first extent's chunk this node owns
is also written as a file of its own, CACHE_DIR/<dataset uuid>/<row>.file, next to
the staged chunks (the cache limit counts both).

Never an unverified byte: a copy is written extent by extent (copy_file_range from
the staged chunk copy if there is one, else from the store), each extent read back
from the copy and checked against the manifest checksum as it is written; a copy
with a bad extent is never published. A verified copy's identity (device, inode,
size, mtime, ctime) is recorded, and an open passes through only to a file that
still has it (dlfsd.core.passthrough checks with fstat on the very descriptor it
registers): a copy changed on disk since (written to, replaced) is checked again,
extent by extent, before the kernel may read it. Copies a previous mount left are
adopted unverified and checked in the background before their first passthrough.
Bit rot that leaves the inode's times alone is what the chunk copies' first-read
checks catch and this cannot; the scrub (--scrub-rate) does not read these copies.

Which copies exist is shared by every process of the mount (anonymous shared
mappings made before the fork): a state byte and the recorded identity per file.
The FileStager (main process, next to the chunk Stager) makes and checks copies:
those an open asked for first (the open itself is served by the daemon meanwhile),
then adopted copies to check, then the rest in row order.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import logging
import math
import mmap
import os
import stat
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import trio

from dlfs.errors import CorruptDataError
from dlfs.store.format import CHUNK_HEADER_SIZE, checksum
from dlfs.store.store import Dataset, fsync_path
from dlfsd.base.throttle import pace
from dlfsd.pool.chunkcache import TEMP_PREFIX, ChunkCache

log = logging.getLogger(__name__)

LARGE_SHARE = 4  # a file of >= chunk size / LARGE_SHARE is large (as dlfsd.prefetch's)
# and at least this large: a smaller file gains less from passthrough than its open
# costs (a round trip), and a copy of it would double its bytes in the cache for nothing
# (with the default 64 MiB chunks the quarter chunk, 16 MiB, is the bound that counts)
LARGE_MIN = 1 << 20
FILE_DEMAND = 1 << 31  # a DemandChannel record for file copy i carries FILE_DEMAND | i
SUFFIX = ".file"
RETRY_FIRST, RETRY_MAX = 10.0, 300.0  # seconds until a failed copy is tried again

# State byte per large file.
ABSENT = 0  # no copy on disk
PRESENT = 1  # a copy is on disk, not verified by this mount (adopted, or changed since)
VERIFIED = 2  # a copy this mount wrote or checked, extent by extent; its identity recorded

_IDENTITY = np.dtype([("dev", "<u8"), ("ino", "<u8"), ("size", "<u8"), ("mtime", "<i8"),
                      ("ctime", "<i8")])


def identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What changes when a file is written to, truncated or replaced (ctime cannot be
    set back by a user)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def large_rows(dataset: Dataset) -> np.ndarray:
    """Rows of the dataset's regular files of at least a quarter chunk (and LARGE_MIN)."""
    arrays = dataset.directory.arrays
    modes = arrays["mode"].astype(np.uint32)
    regular = (modes & stat.S_IFMT(0xFFFF)) == stat.S_IFREG
    big = arrays["size"] >= max(LARGE_MIN, dataset.chunk_size // LARGE_SHARE)
    return np.flatnonzero(regular & big)


def owned_large_rows(dataset: Dataset, owned: np.ndarray) -> np.ndarray:
    """The large files this node copies whole: those whose first extent's chunk it owns."""
    rows = large_rows(dataset)
    if not len(rows):
        return rows
    arrays = dataset.directory.arrays
    first_chunks = arrays["ext_chunk"][arrays["ext_start"][rows]]
    return rows[np.asarray(owned, dtype=bool)[first_chunks]]


def large_share(datasets: list[Dataset]) -> float:
    """The share of the datasets' file bytes that large files hold (0 when empty)."""
    total = large = 0
    for d in datasets:
        sizes = d.directory.arrays["size"]
        modes = d.directory.arrays["mode"].astype(np.uint32)
        regular = (modes & stat.S_IFMT(0xFFFF)) == stat.S_IFREG
        total += int(sizes[regular].sum())
        large += int(sizes[large_rows(d)].sum())
    return large / total if total else 0.0


class FileCopies:
    """The whole-file copies of one dataset's large files that this node keeps."""

    def __init__(self, cache: ChunkCache, owned: np.ndarray, store_rate: int = 0) -> None:
        """`owned`: per chunk, whether this node owns it; a large file is copied here when
        its first extent's chunk is owned."""
        self.cache = cache
        self.dataset = cache.dataset
        d = self.directory = self.dataset.directory
        self.rows = owned_large_rows(self.dataset, owned)
        self.sizes = d.arrays["size"][self.rows].astype(np.int64)
        self.index = {int(row): i for i, row in enumerate(self.rows)}
        self.store_rate = store_rate
        count = max(1, len(self.rows))
        self._state = mmap.mmap(-1, count)  # shared with the forked workers
        self._state_view = np.frombuffer(self._state, dtype=np.uint8)[:len(self.rows)]
        self._ids = mmap.mmap(-1, count * _IDENTITY.itemsize)
        self._id_view = np.frombuffer(self._ids, dtype=_IDENTITY)[:len(self.rows)]
        self._warned = bytearray(count)  # per process: a changed copy logged once

    def __len__(self) -> int:
        return len(self.rows)

    # -- shared state --------------------------------------------------------------------
    def state(self, i: int) -> int:
        return self._state[i]

    def path(self, i: int) -> Path:
        return self.cache.dir / f"{int(self.rows[i])}{SUFFIX}"

    def staged_bytes(self) -> int:
        """Bytes of copies on disk (what the cache limit counts)."""
        return int(self.sizes[self._state_view != ABSENT].sum())

    def counts(self) -> tuple[int, int, int, int]:
        """(files, verified, on disk unverified, bytes of all files) for status."""
        states = self._state_view
        return (len(self.rows), int(np.count_nonzero(states == VERIFIED)),
                int(np.count_nonzero(states == PRESENT)), int(self.sizes.sum()))

    # -- opens (any process) ---------------------------------------------------------------
    def open_verified(self, i: int) -> int:
        """A descriptor of copy `i` if it is verified and unchanged since (its identity,
        by fstat of this very descriptor, is the one recorded when it was checked); else
        -1, and a copy that changed is marked for checking again (the caller demands it)."""
        if self._state[i] != VERIFIED:
            return -1
        try:
            fd = os.open(self.path(i), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            self._lost(i, f"cannot open it ({err.strerror})")
            return -1
        try:
            st = os.fstat(fd)
        except OSError as err:
            os.close(fd)
            self._lost(i, f"cannot stat it ({err.strerror})")
            return -1
        if identity(st) != tuple(int(x) for x in self._id_view[i]):
            os.close(fd)
            self._lost(i, "it changed on disk since it was checked")
            return -1
        return fd

    def _lost(self, i: int, why: str) -> None:
        """Copy `i` may not be served as it is: check it again (or copy it again)."""
        if self._state[i] == VERIFIED:
            self._state[i] = PRESENT
        if not self._warned[i]:
            self._warned[i] = 1
            log.warning("whole-file copy %s of %s (dataset %s): %s; served by the daemon "
                        "until it is checked again, extent by extent", self.path(i),
                        self.directory.path(int(self.rows[i])).decode(errors="replace"),
                        self.dataset.name, why)

    # -- mount time (main process, before the fork) --------------------------------------
    def scan(self) -> int:
        """Adopt the copies an earlier mount left (right size: checked before their first
        passthrough); remove other `.file` entries. Returns how many were adopted."""
        adopted = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self.cache.dir) as entries:
            for entry in entries:
                if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                    continue
                stem = entry.name[: -len(SUFFIX)]
                i = self.index.get(int(stem)) if stem.isdigit() else None
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                    regular = entry.is_file(follow_symlinks=False)
                except OSError:
                    continue
                if i is not None and regular and size == self.sizes[i]:
                    self._state[i] = PRESENT
                    adopted += 1
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        return adopted

    # -- copying and checking (a thread of the main process) ------------------------------
    def stage(self, i: int, buffer: bytearray, stopping: Callable[[], bool]) -> str:
        """Make copy `i` verified: check the copy on disk if there is one (a bad one is
        removed), else write one. Returns what was done: "checked", "copied", "stopped"."""
        if self._state[i] == PRESENT:
            if self._check(i, buffer, stopping):
                return "checked"
            if stopping():
                return "stopped"
        return "copied" if self._copy(i, buffer, stopping) else "stopped"

    def _extents(self, i: int):
        """(extent, position in the file) of file `i`, in order."""
        row = int(self.rows[i])
        piece = self.directory.extent_size
        first = self.directory.first_extent(row)
        for ext in self.directory.extents(row):
            yield ext, (ext - first) * piece

    def _check(self, i: int, buffer: bytearray, stopping: Callable[[], bool]) -> bool:
        """Check the copy on disk extent by extent; record it verified, or remove it."""
        d = self.directory
        path = self.path(i)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._state[i] = ABSENT
            return False
        try:
            st = os.fstat(fd)  # before reading: a change during the check changes it
            bad = "" if st.st_size == self.sizes[i] else "wrong size"
            for ext, pos in self._extents(i):
                if bad or stopping():
                    break
                length = d.ext_length_view[ext]
                view = memoryview(buffer)[:length]
                if os.preadv(fd, [view], pos) != length:
                    bad = "short"
                elif checksum(view) != d.ext_checksum_view[ext]:
                    bad = f"checksum mismatch in extent {ext}"
        finally:
            os.close(fd)
        if stopping() and not bad:
            return False
        if bad:
            log.error("whole-file copy %s of dataset %s is bad (%s); removed, copying it "
                      "again", path, self.dataset.name, bad)
            self._remove(i)
            return False
        self._verified(i, st)
        return True

    def _remove(self, i: int) -> None:
        self._state[i] = ABSENT
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(i))

    def _verified(self, i: int, st: os.stat_result) -> None:
        self._id_view[i] = identity(st)  # the identity first: an open reads it after
        self._state[i] = VERIFIED  # the state
        self._warned[i] = 0

    def _copy(self, i: int, buffer: bytearray, stopping: Callable[[], bool]) -> bool:
        """Write copy `i` under a temporary name, checking each extent as it is written
        (read back from the copy), then sync and rename it into place. False if
        stopped; CorruptDataError or OSError if it could not be made."""
        self._remove(i)
        temp = self.cache.dir / f"{TEMP_PREFIX}{int(self.rows[i])}{SUFFIX}.{os.getpid()}"
        sources: dict[int, int] = {}
        try:
            dst = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                for ext, pos in self._extents(i):
                    if stopping():
                        return False
                    self._copy_extent(ext, pos, dst, sources, buffer)
                os.fsync(dst)
                os.rename(temp, self.path(i))
                st = os.fstat(dst)  # after the rename, which sets the ctime
            finally:
                os.close(dst)
            fsync_path(self.cache.dir)
        finally:
            for fd in sources.values():
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        self._verified(i, st)
        return True

    def _source(self, chunk: int, sources: dict[int, int]) -> int:
        """The chunk's staged copy if there is one (node-local), else the store's file."""
        fd = sources.get(chunk)
        if fd is None:
            fd = -1
            if self.cache.is_staged(chunk):
                with contextlib.suppress(FileNotFoundError):
                    fd = os.open(self.cache.path(chunk), os.O_RDONLY | os.O_CLOEXEC)
            if fd < 0:
                fd = os.open(self.dataset.chunk_path(chunk), os.O_RDONLY | os.O_CLOEXEC)
            sources[chunk] = fd
        return fd

    def _copy_extent(self, ext: int, pos: int, dst: int, sources: dict[int, int],
                     buffer: bytearray) -> None:
        d = self.directory
        chunk, length = d.ext_chunk_view[ext], d.ext_length_view[ext]
        src = self._source(chunk, sources)
        at = CHUNK_HEADER_SIZE + d.ext_offset_view[ext]
        started = time.monotonic()
        done = 0
        while done < length:
            try:
                n = os.copy_file_range(src, dst, length - done, at + done, pos + done)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS,
                                     errno.EOPNOTSUPP):
                    raise
                n = os.pwrite(dst, os.pread(src, length - done, at + done), pos + done)
            if not n:
                raise CorruptDataError(f"chunk {chunk} of {self.dataset.name} ends early")
            done += n
        if self.store_rate:
            pace(self.store_rate, length, started)
        view = memoryview(buffer)[:length]
        if os.preadv(dst, [view], pos) != length or checksum(view) != d.ext_checksum_view[ext]:
            raise CorruptDataError(f"checksum mismatch in extent {ext} (chunk {chunk}) of "
                                   f"dataset {self.dataset.name}, as copied")

    def close(self) -> None:
        del self._state_view, self._id_view  # release the exports before closing
        with contextlib.suppress(BufferError):  # a view a traceback still holds: GC's
            self._state.close()
            self._ids.close()


class FileStager:
    """Makes and checks the node's whole-file copies in the main process (a trio task
    beside the chunk Stager's jobs): demanded first, then adopted copies to check,
    then the rest in row order. `fits(nbytes)`: whether the cache limit has room."""

    def __init__(self, copies: list[FileCopies | None], fits: Callable[[int], bool]) -> None:
        self.copies = copies
        self.fits = fits
        self._urgent: deque[tuple[int, int]] = deque()
        self._queued: set[tuple[int, int]] = set()
        order = []
        for ds, c in enumerate(copies):
            if c is None:
                continue
            present = [i for i in range(len(c)) if c.state(i) == PRESENT]
            order += [(ds, i) for i in present]
        for ds, c in enumerate(copies):
            if c is not None:
                order += [(ds, i) for i in range(len(c)) if c.state(i) == ABSENT]
        self._order = deque(order)
        self._retries: list[tuple[float, int, int]] = []
        self._failures: dict[tuple[int, int], int] = {}
        self.over_limit: set[tuple[int, int]] = set()
        self.busy: tuple[int, int] | None = None
        self.busy_bytes = 0
        self.copied_files = self.checked_files = self.failed = 0
        self._wake = trio.Event()

    def demand(self, ds: int, i: int) -> None:
        """An open found copy `i` absent or changed: make or check it next."""
        c = self.copies[ds] if ds < len(self.copies) else None
        if c is None or i >= len(c) or (ds, i) in self._queued:
            return
        self._queued.add((ds, i))
        self._urgent.append((ds, i))
        self._wake.set()
        self._wake = trio.Event()

    def _next(self) -> tuple[int, int] | None:
        now = trio.current_time()
        while self._urgent:
            item = self._urgent.popleft()
            self._queued.discard(item)
            if self._eligible(*item):
                return item
        while self._retries and self._retries[0][0] <= now:
            _, ds, i = heapq.heappop(self._retries)
            if self._eligible(ds, i):
                return ds, i
        while self._order:
            item = self._order.popleft()
            if self._eligible(*item):
                return item
        return None

    def _eligible(self, ds: int, i: int) -> bool:
        c = self.copies[ds]
        if c is None or c.state(i) == VERIFIED:
            return False
        if c.state(i) == ABSENT and not self.fits(int(c.sizes[i])):
            self.over_limit.add((ds, i))
            return False
        return True

    async def run(self, stopping: Callable[[], bool]) -> None:
        """Copy and check until cancelled (unmount)."""
        extent = max((c.directory.extent_size for c in self.copies if c is not None),
                     default=1)
        buffer = bytearray(extent)
        while True:
            item = self._next()
            if item is None:
                due = self._retries[0][0] if self._retries else math.inf
                with trio.move_on_at(due):
                    await self._wake.wait()
                continue
            ds, i = item
            c = self._of(ds)
            self.busy, self.busy_bytes = item, int(c.sizes[i])
            try:
                done = await trio.to_thread.run_sync(self._stage_caught, c, i, buffer,
                                                     stopping)
            finally:
                self.busy, self.busy_bytes = None, 0
            if isinstance(done, Exception):
                self._failed(ds, i, done)
            elif done == "copied":
                self.copied_files += 1
                self._failures.pop(item, None)
            elif done == "checked":
                self.checked_files += 1

    @staticmethod
    def _stage_caught(c: FileCopies, i: int, buffer: bytearray,
                      stopping: Callable[[], bool]) -> str | Exception:
        try:
            return c.stage(i, buffer, stopping)
        except (CorruptDataError, OSError) as err:
            return err

    def _failed(self, ds: int, i: int, err: Exception) -> None:
        self.failed += 1
        n = self._failures[(ds, i)] = self._failures.get((ds, i), 0) + 1
        delay = min(RETRY_FIRST * 2.0 ** (n - 1), RETRY_MAX)
        heapq.heappush(self._retries, (trio.current_time() + delay, ds, i))
        c = self._of(ds)
        log.error("cannot make the whole-file copy of %s (dataset %s): %s; its opens are "
                  "served by the daemon, trying again in %.3g s",
                  c.directory.path(int(c.rows[i])).decode(errors="replace"),
                  c.dataset.name, err, delay)

    def _of(self, ds: int) -> FileCopies:
        """The copies of dataset `ds`, which has some (only such datasets are queued)."""
        c = self.copies[ds]
        if c is None:
            raise ValueError(f"dataset {ds} has no whole-file copies")
        return c

    def staged_bytes(self) -> int:
        """Bytes of copies on disk or being written (the cache limit counts them)."""
        return sum(c.staged_bytes() for c in self.copies if c is not None) + self.busy_bytes

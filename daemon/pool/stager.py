"""Stager: copies this node's share of chunks from the store onto local NVMe.

It runs in the daemon's main process while the mount already serves reads.
Chunks a reader asked for (it had to go to the store, or found a corrupt
copy) jump the queue: any process sends (dataset, chunk) down a pipe
created before the workers forked. Each copy is written under a temporary
name, read back and its header and every extent checksum checked, then synced
and renamed into the cache; a copy that fails verification is never published.
A chunk whose copy failed is tried again after a backoff (RETRY_FIRST, doubling
up to RETRY_MAX), and a cache disk that cannot be written (full, read-only)
pauses all staging the same way: a moment's ENOSPC must not end staging for the
mount, and a bad store copy must not be copied in a loop. `--cache-limit` caps
what is staged. What is not staged (yet) is read from peers or the store.

With `--replicas R > 1` a chunk this node owns as a secondary owner is copied
from its primary over the pool, not from the store (dlfsd.pool.replicate): the
store serves each chunk once per job. Chunks this node is primary of are staged
first, then the others, at most WAITING_WINDOW of them waiting for a primary
that has not staged them yet (asked again every POLL_SECONDS, never blocking a
copy job); a primary that is down or stays silent sends them to the store.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import logging
import math
import mmap
import os
import struct
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trio

from dlfs.errors import CorruptDataError, FormatError
from dlfs.store.format import CHUNK_HEADER_SIZE, check_chunk_header, checksum
from dlfs.store.store import Dataset
from dlfsd.base.throttle import pace
from dlfsd.pool import replicate
from dlfsd.pool.chunkcache import ChunkCache
from dlfsd.pool.filecopies import FILE_DEMAND, FileStager
from dlfsd.pool.peer import PeerError
from dlfsd.pool.replicate import POLL_SECONDS, PrimaryNotReady, ReplicaSource

log = logging.getLogger(__name__)

READ_BLOCK = 8 << 20
RETRY_FIRST = 10.0  # seconds until a failed copy (or a full cache disk) is tried again,
RETRY_MAX = 300.0  # doubling per failure up to this
# Errors of the cache disk itself, not of one chunk: they pause all staging.
CACHE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


class DemandChannel:
    """(dataset, chunk) requests from any process to the stager; lossy when full."""

    RECORD = struct.Struct("<HI")

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def send(self, ds: int, chunk: int) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the stager is far behind anyway
            os.write(self.write_fd, self.RECORD.pack(ds, chunk))

    async def receive(self) -> AsyncIterator[tuple[int, int]]:
        """Yield requests as they arrive (main process only)."""
        size = self.RECORD.size
        pending = b""
        while True:
            await trio.lowlevel.wait_readable(self.read_fd)
            try:
                pending += os.read(self.read_fd, 65536 - 65536 % size)
            except BlockingIOError:
                continue
            whole = len(pending) - len(pending) % size
            for ds, chunk in self.RECORD.iter_unpack(pending[:whole]):
                yield ds, chunk
            pending = pending[whole:]

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class Backoff:
    """Consecutive failures of one thing (a chunk's copy, the cache disk) and when
    (trio clock) it may be tried again; a success forgets them."""

    failures: int = 0
    due: float = float("-inf")
    error: str = ""  # the last failure, for `dlfs status`

    def waiting(self, now: float) -> bool:
        return now < self.due

    def fail(self, now: float) -> tuple[float, bool]:
        """Count a failure: (the delay until the next try, whether it grew: log then)."""
        before = self.delay()
        self.failures += 1
        delay = self.delay()
        self.due = now + delay
        return delay, delay != before

    def delay(self) -> float:
        if not self.failures:
            return 0.0
        return min(RETRY_FIRST * 2.0 ** min(self.failures - 1, 30), RETRY_MAX)


@dataclass
class StageProgress:
    """What `dlfs status` shows for one dataset."""

    owned_chunks: int
    owned_bytes: int
    staged_chunks: int
    staged_bytes: int
    rate: float  # bytes/s copied since the mount started staging
    eta: float | None  # seconds until every owned chunk that fits is staged


class Stager:
    """Background copier of owned chunks, demanded ones first."""

    def __init__(self, datasets: list[Dataset], caches: list[ChunkCache],
                 owned: list[np.ndarray], demand: DemandChannel, jobs: int = 2,
                 cache_limit: int = 0, store_rate: int = 0,
                 replicas: ReplicaSource | None = None) -> None:
        """`replicas`: where secondary owners copy from (None: every chunk from the store)."""
        self.datasets = datasets
        self.caches = caches
        self.owned_masks = owned
        self.replicas = replicas
        # Owned chunks in staging order: those copied from the store (this node is their
        # primary) first, then those copied from their primaries, which meanwhile stage
        # theirs; _primary_end[ds] is where the second part starts.
        self._owned_lists, self._primary_end = [], []
        for ds, mask in enumerate(owned):
            from_peer = np.zeros_like(mask) if replicas is None or not replicas.wait \
                else replicas.primaries[ds] >= 0
            first, then = np.flatnonzero(mask & ~from_peer), np.flatnonzero(mask & from_peer)
            self._owned_lists.append(np.concatenate([first, then]))
            self._primary_end.append(len(first))
        self._cursor = [0] * len(datasets)
        self.demand = demand
        self.jobs = jobs
        self.cache_limit = cache_limit
        self.store_rate = store_rate
        self._urgent: deque[tuple[int, int]] = deque()
        self._queued: set[tuple[int, int]] = set()  # in _urgent: secondaries ask again and
        # again for a chunk their primary has not staged yet; it is queued once
        self._busy: dict[tuple[int, int], int] = {}
        self._failed: dict[tuple[int, int], Backoff] = {}
        self._retries: list[tuple[float, int, int]] = []  # heap of (due, ds, chunk)
        self._cache_pause = Backoff()  # the cache disk cannot be written
        # What will_stage reads, in shared memory: the peer server asks it from processes
        # of its own (dlfsd.pool.peerprocs), forked after this was made. The pause in
        # time.monotonic() (one clock for every process), and a byte per chunk passed
        # over for --cache-limit.
        self._shared = mmap.mmap(-1, 8 + sum(max(1, d.chunk_count) for d in datasets))
        self._paused_until = np.frombuffer(self._shared, np.float64, 1)
        self._declined, at = [], 8
        for d in datasets:
            self._declined.append(np.frombuffer(self._shared, np.uint8, d.chunk_count, at))
            at += max(1, d.chunk_count)
        # For `dlfs status` (health()): demanded chunks -> when first demanded (monotonic),
        # chunks passed over for --cache-limit, copies that failed since mount.
        self._demanded: dict[tuple[int, int], float] = {}
        self._over_limit: set[tuple[int, int]] = set()
        self.copy_errors = 0
        self._wake = trio.Event()
        self._stopping = False
        self._by_chunk = [d.directory.extents_by_chunk(d.chunk_count) for d in datasets]
        self.copied_bytes = 0
        self.copied_chunks = 0
        self.started = time.monotonic()
        self.finished: float | None = None
        self.files: FileStager | None = None  # whole-file copies (attach_files)

    def attach_files(self, files: FileStager) -> None:
        """Also make the node's whole-file copies of large files (FUSE passthrough,
        dlfsd.pool.filecopies): their bytes count against --cache-limit too."""
        self.files = files

    # -- scheduling -----------------------------------------------------------------
    async def run(self) -> None:
        """Stage until cancelled (unmount); idle jobs wait for demands."""
        self.started = time.monotonic()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._stop_when_cancelled)
                nursery.start_soon(self._receive_demands)
                for _ in range(self.jobs):
                    nursery.start_soon(self._job)
                if self.files is not None:
                    nursery.start_soon(self.files.run, lambda: self._stopping)
        finally:
            self._stopping = True

    async def _stop_when_cancelled(self) -> None:
        """Raise the stop flag the moment the nursery is cancelled, not once it is done.

        The copy threads cannot be cancelled (to_thread.run_sync waits for them), so the
        nursery waits for every copy in flight: without the flag they would each run to
        the end of a whole chunk (up to 2 GiB) before the unmount could go on.
        """
        try:
            await trio.sleep_forever()
        finally:
            self._stopping = True

    async def _receive_demands(self) -> None:
        async for ds, chunk in self.demand.receive():
            if chunk & FILE_DEMAND:  # an open wants a whole-file copy made or checked
                if self.files is not None:
                    self.files.demand(ds, chunk & ~FILE_DEMAND)
                continue
            if ds < len(self.datasets) and chunk < self.datasets[ds].chunk_count:
                if (ds, chunk) in self._queued:
                    continue
                self._queued.add((ds, chunk))
                self._urgent.append((ds, chunk))
                if self.owned_masks[ds][chunk]:
                    self._demanded.setdefault((ds, chunk), time.monotonic())
                self._wake_jobs()

    def _wake_jobs(self) -> None:
        """Wake every idle job; the next idle ones wait on a fresh event.

        Only the waker replaces the event: a job that replaced it after waking would
        leave a job that woke with it waiting on an event nobody sets any more.
        """
        self._wake.set()
        self._wake = trio.Event()

    async def _job(self) -> None:
        buffer = bytearray()
        while True:
            item = self._next()
            if item is None:
                if self.finished is None and not self._urgent and not self._waiting_for_peers():
                    self.finished = time.monotonic()
                with trio.move_on_at(self._next_due()):  # a retry comes due meanwhile
                    await self._wake.wait()  # no checkpoint since _next(): none is missed
                continue
            ds, chunk = item
            node = self.replicas.source(ds, chunk) if self.replicas is not None else None
            self._busy[item] = int(self.datasets[ds].chunk_lengths[chunk])
            try:
                buffer, error = await trio.to_thread.run_sync(self._copy_caught, ds, chunk,
                                                              buffer, node)
            finally:
                del self._busy[item]
            if isinstance(error, PrimaryNotReady):  # ask it again soon; others meanwhile
                heapq.heappush(self._retries, (trio.current_time() + POLL_SECONDS, ds, chunk))
            elif error is None:
                self._failed.pop(item, None)
                self._cache_pause.failures = 0  # the disk took a whole copy
            else:
                self._copy_failed(ds, chunk, error)

    def _next(self) -> tuple[int, int] | None:
        now = trio.current_time()
        if self._cache_pause.waiting(now):
            # Nothing can be written: keep the cursor, drop demands (readers demand a
            # chunk again each time they read it from the store) so they cannot pile up.
            self._urgent.clear()
            self._queued.clear()
            return None
        while self._urgent:
            ds, chunk = self._urgent.popleft()
            self._queued.discard((ds, chunk))
            if self._eligible(ds, chunk):
                return ds, chunk
        while self._retries and self._retries[0][0] <= now:
            _, ds, chunk = heapq.heappop(self._retries)
            if self._eligible(ds, chunk):
                return ds, chunk
        for part in (self._primary_end, [len(c) for c in self._owned_lists]):
            for ds, chunks in enumerate(self._owned_lists):
                while self._cursor[ds] < part[ds]:
                    if part is not self._primary_end and self._window_full():
                        return None  # copies from primaries: enough are waiting already
                    chunk = int(chunks[self._cursor[ds]])
                    self._cursor[ds] += 1
                    if self._eligible(ds, chunk):
                        return ds, chunk
        return None

    def _window_full(self) -> bool:
        """As many chunks wait for their primaries (or are being asked for) as may."""
        replicas = self.replicas
        if replicas is None:  # (not asked then: no chunk is copied from a primary)
            return False
        asking = sum(1 for ds, chunk in self._busy if replicas.is_secondary(ds, chunk)
                     and not replicas.is_waiting(ds, chunk))
        return replicas.waiting_count() + asking >= replicate.WAITING_WINDOW

    def _waiting_for_peers(self) -> bool:
        return self.replicas is not None and self.replicas.waiting_count() > 0

    def _next_due(self) -> float:
        """When an idle job must look again without being woken: a retry comes due, or
        the pause ends (retries due before that wait for it: no job may spin on them)."""
        if self._cache_pause.waiting(trio.current_time()):
            return self._cache_pause.due
        return self._retries[0][0] if self._retries else math.inf

    def _eligible(self, ds: int, chunk: int) -> bool:
        if not self.owned_masks[ds][chunk]:
            return False
        if (ds, chunk) in self._busy:
            return False
        if self.caches[ds].is_staged(chunk):
            if self.replicas is not None:
                self.replicas.forget(ds, chunk)
            return False
        backoff = self._failed.get((ds, chunk))
        if backoff is not None and backoff.waiting(trio.current_time()):
            return False
        if self._fits(int(self.datasets[ds].chunk_lengths[chunk])):
            return True
        self._over_limit.add((ds, chunk))
        self._declined[ds][chunk] = 1
        if self.replicas is not None:
            self.replicas.forget(ds, chunk)
        return False

    def _fits(self, length: int) -> bool:
        if not self.cache_limit:
            return True
        # A copy is published (staged) by its thread a moment before its job takes it
        # off _busy: counted twice then, every other chunk looked too big and was
        # passed over for good (staging stopped short of the limit, 1 run in 3).
        in_flight = sum(n for (ds, chunk), n in self._busy.items()
                        if not self.caches[ds].is_staged(chunk))
        used = sum(c.staged_bytes() for c in self.caches) + in_flight
        if self.files is not None:
            used += self.files.staged_bytes()
        return used + length <= self.cache_limit

    def fits_file(self, length: int) -> bool:
        """Whether a whole-file copy of `length` bytes fits under --cache-limit beside
        every owned chunk not staged yet (trio thread only): under a limit the chunks
        come first (peers read them, and every read works without the file copies)."""
        if not self.cache_limit:
            return True
        unstaged = sum(int(d.chunk_lengths[mask & ~c.staged_mask()].sum())
                       for d, mask, c in zip(self.datasets, self.owned_masks, self.caches,
                                             strict=True))
        return self._fits(length + unstaged)

    def _copy_failed(self, ds: int, chunk: int, err: Exception) -> None:
        """Try the chunk again once its backoff (or the cache disk's pause) is over.

        Its own failures count only against the chunk: a store copy that stays bad is
        tried every RETRY_MAX for the rest of the mount, while the other chunks go on.
        """
        now = trio.current_time()
        self.copy_errors += 1
        if isinstance(err, OSError) and err.errno in CACHE_ERRNOS:
            due = self._pause(ds, err, now)
        else:
            backoff = self._failed.setdefault((ds, chunk), Backoff())
            backoff.error = str(err)
            delay, grew = backoff.fail(now)
            due = backoff.due
            if grew:  # once per backoff step, not at every try
                self._log_failure(ds, chunk, err, delay)
        heapq.heappush(self._retries, (due, ds, chunk))

    def _pause(self, ds: int, err: OSError, now: float) -> float:
        """The cache disk cannot be written (full, read-only): stop all copies for a
        backoff, not for good (another job's files may be deleted in a moment). Only
        the first of the jobs that hit it counts; returns when staging resumes."""
        if not self._cache_pause.waiting(now):
            self._cache_pause.error = f"cannot write the cache dir {self.caches[ds].dir}: " \
                                      f"{err.strerror}"
            delay, grew = self._cache_pause.fail(now)
            self._paused_until[0] = time.monotonic() + delay
            if grew:
                log.error("staging paused for %.3g s: cannot write the cache dir %s (%s); "
                          "reads go to peers and the store", delay, self.caches[ds].dir,
                          err.strerror)
        return self._cache_pause.due

    def will_stage(self, ds: int, chunk: int) -> bool:
        """Whether an owned chunk that is not staged will be soon: not while the cache
        disk cannot be written, nor one passed over for --cache-limit. Called by the peer
        server, in any process: reads shared memory, takes no lock."""
        if not self.owned_masks[ds][chunk] or time.monotonic() < self._paused_until[0]:
            return False
        return not self._declined[ds][chunk]

    def _log_failure(self, ds: int, chunk: int, err: Exception, delay: float) -> None:
        name = self.datasets[ds].name
        if isinstance(err, (CorruptDataError, FormatError)):
            log.error("not staging chunk %d of %s for %.3g s: the store copy is bad (%s); "
                      "reads of it are checked and fail with EIO", chunk, name, delay, err)
        else:
            log.error("cannot stage chunk %d of %s (%s); trying again in %.3g s", chunk,
                      name, err, delay)

    # -- copying (in a worker thread) -----------------------------------------------------
    def _copy_caught(self, ds: int, chunk: int, buffer: bytearray,
                     node: int | None = None) -> tuple[bytearray, Exception | None]:
        """Copy one chunk (from primary `node`, else the store); return a failure (for
        _copy_failed) or PrimaryNotReady instead of raising it."""
        replicas = self.replicas  # (not None where a node is named: it named it)
        try:
            if node is not None and replicas is not None:
                try:
                    return self._copy_from_peer(replicas, node, ds, chunk, buffer), None
                except (PeerError, CorruptDataError, FormatError) as err:
                    replicas.failed(node, ds, chunk, err)  # the store, now
            return self._copy(ds, chunk, buffer), None
        except (CorruptDataError, FormatError, OSError, PrimaryNotReady) as err:
            return buffer, err

    def _copy(self, ds: int, chunk: int, buffer: bytearray) -> bytearray:
        """Copy in the kernel (copy_file_range, like cp), then verify the copy itself.

        Checking the written copy rather than the bytes read catches a bad store
        copy and a bad write alike, and keeps the data out of user space but once.
        """
        dataset, cache = self.datasets[ds], self.caches[ds]
        total = CHUNK_HEADER_SIZE + int(dataset.chunk_lengths[chunk])
        source = dataset.chunk_path(chunk)
        temp = cache.temp_path(chunk)
        try:
            with open(source, "rb", buffering=0) as src, \
                    open(temp, "wb", buffering=0, opener=_private) as dst:
                if os.fstat(src.fileno()).st_size < total:
                    raise CorruptDataError(f"chunk file is truncated: {source}")
                copied = self._copy_range(src.fileno(), dst.fileno(), total)
            if not copied or self._stopping:  # unmounting: abandon it, verifying included
                _discard(temp)
                return buffer
            buffer = self._check_copy(ds, chunk, temp, buffer, str(source))
        except BaseException:
            _discard(temp)
            raise
        if self.replicas is not None:
            self.replicas.count_store_copy(total - CHUNK_HEADER_SIZE)
        self.copied_bytes += total - CHUNK_HEADER_SIZE
        self.copied_chunks += 1
        return buffer

    def _copy_from_peer(self, replicas: ReplicaSource, node: int, ds: int, chunk: int,
                        buffer: bytearray) -> bytearray:
        """Copy the chunk from its primary `node` over the pool, then verify the written
        copy as a store copy is (a bad primary copy is never published)."""
        dataset, cache = self.datasets[ds], self.caches[ds]
        temp = cache.temp_path(chunk)
        try:
            with open(temp, "wb", buffering=0, opener=_private) as dst:
                copied = replicas.copy(node, ds, chunk, dst.fileno(),
                                       lambda: self._stopping)
            if not copied or self._stopping:
                _discard(temp)
                return buffer
            where = f"the copy from peer {replicas.view.nodes[node].name}"
            buffer = self._check_copy(ds, chunk, temp, buffer, where)
        except BaseException:
            _discard(temp)
            raise
        replicas.copied(node, ds, chunk)
        self.copied_bytes += int(dataset.chunk_lengths[chunk])
        self.copied_chunks += 1
        return buffer

    def _check_copy(self, ds: int, chunk: int, temp: Path, buffer: bytearray,
                    source: str) -> bytearray:
        """Read the written copy back, check its header and every extent, publish it.
        Returns the (maybe grown) read buffer."""
        dataset = self.datasets[ds]
        total = CHUNK_HEADER_SIZE + int(dataset.chunk_lengths[chunk])
        if len(buffer) < total:
            buffer = bytearray(total)
        view = memoryview(buffer)[:total]
        with open(temp, "rb", buffering=0) as copy:
            got = 0
            while got < total:  # one read returns at most 2 GiB - 4 KiB (Linux)
                n = copy.readinto(view[got:])
                if not n:
                    raise CorruptDataError(f"short copy of {source}")
                got += n
        check_chunk_header(bytes(view[:CHUNK_HEADER_SIZE]), Path(source), chunk, dataset.uuid)
        self._check_extents(ds, chunk, view, source)
        self.caches[ds].publish(chunk, temp)
        return buffer

    def _copy_range(self, src: int, dst: int, total: int) -> bool:
        """Copy `total` bytes in READ_BLOCK steps (paced when the store is throttled);
        False if unmounting interrupted it."""
        pos = 0
        use_kernel_copy = hasattr(os, "copy_file_range")
        while pos < total:
            if self._stopping:
                return False
            started = time.monotonic()
            want = min(READ_BLOCK, total - pos)
            n = 0
            if use_kernel_copy:
                try:
                    n = os.copy_file_range(src, dst, want, pos, pos)
                except OSError as err:
                    if err.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS,
                                         errno.EOPNOTSUPP):
                        raise
                    use_kernel_copy = False
            if not use_kernel_copy:
                data = os.pread(src, want, pos)
                n = os.pwrite(dst, data, pos) if data else 0
            if not n:
                raise CorruptDataError("chunk file ended early")
            pace(self.store_rate, n, started)
            pos += n
        return True

    def _check_extents(self, ds: int, chunk: int, view: memoryview, source: str) -> None:
        d = self.datasets[ds].directory
        order, bounds = self._by_chunk[ds]
        offsets, lengths, sums = d.ext_offset_view, d.ext_length_view, d.ext_checksum_view
        for ext in order[bounds[chunk] : bounds[chunk + 1]]:
            start = CHUNK_HEADER_SIZE + offsets[ext]
            if checksum(view[start : start + lengths[ext]]) != sums[ext]:
                raise CorruptDataError(f"checksum mismatch in extent {ext} of {source}")

    # -- reporting ---------------------------------------------------------------------
    def progress(self) -> list[StageProgress]:
        elapsed = max((self.finished or time.monotonic()) - self.started, 1e-9)
        rate = self.copied_bytes / elapsed
        idle = self.finished is not None and not self._busy and not self._urgent
        out = []
        for ds, dataset in enumerate(self.datasets):
            owned = self.owned_masks[ds]
            staged = owned & self.caches[ds].staged_mask()
            lengths = dataset.chunk_lengths
            owned_bytes, staged_bytes = int(lengths[owned].sum()), int(lengths[staged].sum())
            remaining = owned_bytes - staged_bytes
            if not remaining:
                eta = 0.0
            elif idle or rate <= 0:  # the rest is not being staged: over --cache-limit,
                eta = None  # or failed copies waiting to be tried again
            else:
                eta = remaining / rate
            out.append(StageProgress(int(owned.sum()), owned_bytes, int(staged.sum()),
                                     staged_bytes, rate, eta))
        return out

    def health(self) -> StagingHealth:
        """What keeps owned chunks off this node's NVMe, for `dlfs status` (main process).

        Reading only, apart from forgetting demands and limit skips of chunks that
        are staged by now.
        """
        for key in [k for k in self._demanded if self._staged(k)]:
            del self._demanded[key]
        for ds, chunk in [k for k in self._over_limit if self._staged(k)]:
            self._over_limit.discard((ds, chunk))
            self._declined[ds][chunk] = 0
        now_mono = time.monotonic()
        n = len(self.datasets)
        out = StagingHealth([0] * n, [0] * n, [0] * n, [0.0] * n, [0] * n, [None] * n,
                            self.copy_errors, self.cache_limit)
        for ds, chunk in self._over_limit:
            out.over_limit_chunks[ds] += 1
            out.over_limit_bytes[ds] += int(self.datasets[ds].chunk_lengths[chunk])
        for (ds, chunk), since in self._demanded.items():
            if (ds, chunk) in self._over_limit or (ds, chunk) in self._failed:
                continue  # reported as such: not waiting for a copy job
            out.demanded_chunks[ds] += 1
            out.demanded_oldest[ds] = max(out.demanded_oldest[ds], now_mono - since)
        now = _trio_now()
        for (ds, chunk), backoff in sorted(self._failed.items()):
            out.failing_chunks[ds] += 1
            if out.failing_example[ds] is None:
                retry = max(0.0, backoff.due - now) if now is not None else None
                out.failing_example[ds] = (chunk, backoff.error, retry)
        if now is not None and self._cache_pause.waiting(now):
            out.paused = (self._cache_pause.due - now, self._cache_pause.error)
        return out

    def _staged(self, key: tuple[int, int]) -> bool:
        return self.caches[key[0]].is_staged(key[1])


@dataclass
class StagingHealth:
    """Per dataset (lists by dataset index): owned chunks not staged and why."""

    over_limit_chunks: list[int]  # passed over: they did not fit in --cache-limit
    over_limit_bytes: list[int]
    demanded_chunks: list[int]  # readers or peers asked for them; waiting for a copy job
    demanded_oldest: list[float]  # seconds since the oldest of those demands
    failing_chunks: list[int]  # their last copy failed; tried again after a backoff
    failing_example: list[tuple[int, str, float | None] | None]  # (chunk, error, retry in s)
    copy_errors: int  # copies that failed since mount (all datasets)
    cache_limit: int
    paused: tuple[float, str] | None = None  # (seconds left, why): the cache disk failed


def _trio_now() -> float | None:
    """The trio clock the backoffs use; None outside trio (before the stager ever ran)."""
    try:
        return trio.current_time()
    except RuntimeError:
        return None


def _discard(temp: Path) -> None:
    """Remove an unfinished or rejected copy: only verified copies are ever renamed in."""
    with contextlib.suppress(OSError):
        temp.unlink()


def _private(path, flags: int) -> int:
    """Open a staged copy 0600 (see ChunkCache.scan)."""
    return os.open(path, flags, 0o600)

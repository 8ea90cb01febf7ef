"""ChunkPrefetch: pull a sample's chunk file (or a large file's own bytes) into the page cache.

Why: an epoch reads samples in random order, each a small random read of some
chunk file; the same bytes read as whole chunks are sequential I/O, which a
disk or a parallel file system delivers many times faster. So the first time
any sample of a chunk is read from the store, the whole chunk is queued to be
read start to end in the background, and the epoch's later samples from that
chunk hit the page cache. One stream per process, chunk after chunk: asking
the kernel for all of them at once (posix_fadvise WILLNEED) flooded the disk
queue and made the epoch's own reads wait (1,511 files/s instead of 2,336
without prefetch, bench/random_read.py tree, cold). For the same reason a
chunk stream reads without kernel read-ahead (FADV_RANDOM): one 1 MiB disk
request at a time, so an epoch read that misses waits behind at most that
piece per stream, not behind megabytes of read-ahead. With read-ahead the
streams filled the page cache as fast, but the epoch's readers got almost
nothing done until they had (bench/random_read.py cold 110 KiB: 3,977-3,985
files/s with read-ahead, 5,242-6,132 without, two A/B runs each).

A large file (a quarter of a chunk or more: volumes, shards, archives) is
different: its reader wants that file from where it reads on, not its chunk
neighbours. Its first read queues the file's own next chunk size of bytes
(a window), across its chunks, as one stream ahead of the reader; when the
reader gets halfway through a window, the next one is queued (like the
kernel's read-ahead marker), so the stream stays ahead without queueing a
whole 100 GB file for a reader that wanted its header only. Whole chunks
would also read the neighbours' bytes (a 146 MiB file touches three 64 MiB
chunks: 192 MiB read from disk for 146), and one process's chunks were read
by several workers' streams at once, which interleaved on the disk.

Each stream opens the chunk file itself, so its kernel read-ahead state is
its own: a large file's stream runs megabytes ahead of its 1 MiB steps, which
the workers' reads at other offsets of a shared file description kept
resetting (then every step waited for its own disk read); a chunk stream
switches read-ahead off (above) without switching it off for the workers.

Only where it pays and fits (see `prefetch_decision`): single-node mounts
(with a chunk pool, staging does this for the node's own share, and pulling
every chunk to every node would multiply the store's load), and only when
the mounted datasets fit in a quarter of the memory available at mount time
(their bytes can sit in the page cache twice: chunk files and mounted files).
`dlfs mount --prefetch off` switches it off.

One byte per chunk and one per extent in shared mappings say what was asked
for already (by any process of the mount; for an extent, also whether reading
it queues the next window); the reads run on one daemon thread per process,
started lazily so forked workers get their own.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading
from collections.abc import Callable

from dlfs.store.format import CHUNK_HEADER_SIZE

MEMORY_SHARE = 4  # prefetch only if datasets <= available memory / MEMORY_SHARE
LARGE_SHARE = 4  # a file of >= chunk size / LARGE_SHARE is prefetched as itself
PIECE = 1 << 20  # bytes per sendfile call: small, so the epoch's own reads get turns

# (chunk file, start, end or None for its end, whole chunk: then also read [0, start))
_Range = tuple[str, int, int | None, bool]
_ASKED, _NEXT = 1, 2  # extent marks: queued; queued, and reading it queues the next window


class ChunkPrefetch:
    """Reads chunk files (small samples) or a large file's ranges into the page cache,
    once per mount."""

    def __init__(self, chunk_count: int, chunk_size: int, extent_size: int,
                 ext_chunk: memoryview, ext_offset: memoryview, ext_length: memoryview,
                 chunk_path: Callable[[int], os.PathLike | str]) -> None:
        """The extent arrays are the dataset directory's (chunk, offset, length) views."""
        # Shared with forked workers:
        self._chunk_asked = mmap.mmap(-1, max(1, chunk_count))
        self._ext_asked = mmap.mmap(-1, max(1, len(ext_chunk)))
        self._large = max(1, chunk_size // LARGE_SHARE)
        self._window = max(2, chunk_size // max(1, extent_size))  # extents per window
        self._ext_chunk, self._ext_off, self._ext_len = ext_chunk, ext_offset, ext_length
        self._chunk_path = chunk_path
        # Each process's own, made with its reading thread on first use (_put): this
        # one, made before any fork, is never used.
        self._queue: queue.SimpleQueue[list[_Range]] = queue.SimpleQueue()
        self._pid = 0

    def touch(self, ext: int, rel: int, last: int, file_size: int) -> None:
        """Extent `ext` (of a file whose extents end at `last`, inclusive) is being read
        from the store at `rel` bytes into it."""
        if file_size >= self._large:
            mark = self._ext_asked[ext]
            if mark == _ASKED:
                return
            if mark == _NEXT:  # halfway through a window: queue the next one
                self._ext_asked[ext] = _ASKED
                ext += 1
                while ext <= last and self._ext_asked[ext]:
                    ext += 1
            if ext <= last:
                self._put(self._file_ranges(ext, last))
            return
        chunk = self._ext_chunk[ext]
        if self._chunk_asked[chunk]:
            return
        self._chunk_asked[chunk] = 1
        pos = CHUNK_HEADER_SIZE + int(self._ext_off[ext]) + rel
        self._put([(str(self._chunk_path(chunk)), pos - pos % PIECE, None, True)])

    def _file_ranges(self, ext: int, last: int) -> list[_Range]:
        """The chunk ranges of one window of extents from ext (at most to `last`, and
        up to the first one asked for already), contiguous ones merged. Marks them
        asked, and the one halfway as the next window's trigger."""
        ranges: list[_Range] = []
        asked = self._ext_asked
        prev_chunk = prev_end = -1
        trigger = ext + self._window // 2
        for e in range(ext, min(last, ext + self._window - 1) + 1):
            if asked[e]:
                break
            asked[e] = _NEXT if e == trigger else _ASKED
            chunk = int(self._ext_chunk[e])
            start = CHUNK_HEADER_SIZE + int(self._ext_off[e])
            end = start + int(self._ext_len[e])
            if chunk == prev_chunk and start == prev_end:
                ranges[-1] = (*ranges[-1][:2], end, False)
            else:
                # A chunk the file continues into: from its header on, which each
                # worker reads on opening it (else that one page is read from disk on
                # its own when the reader gets there).
                ranges.append((str(self._chunk_path(chunk)), 0 if ranges else start, end,
                               False))
            prev_chunk, prev_end = chunk, end
        return ranges

    def _put(self, ranges: list[_Range]) -> None:
        if not ranges:
            return
        if self._pid != os.getpid():  # first use in this process (workers are forked)
            self._pid = os.getpid()
            self._queue = queue.SimpleQueue()
            threading.Thread(target=_read_forever, args=(self._queue,),
                             name="dlfs-prefetch", daemon=True).start()
        self._queue.put(ranges)

    def close(self) -> None:
        self._chunk_asked.close()
        self._ext_asked.close()


def _read_forever(jobs: queue.SimpleQueue[list[_Range]]) -> None:
    """Read each queued list of ranges, one after the other (a sequential stream),
    into the page cache. sendfile to /dev/null moves no bytes through user space."""
    null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    while True:
        for path, start, end, whole_chunk in jobs.get():
            with contextlib.suppress(OSError):  # removed meanwhile: nothing to do
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if whole_chunk:  # no kernel read-ahead: see the module docstring
                        with contextlib.suppress(OSError):  # a hint; read anyway
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                    _read_range(null, fd, start, end)
                    if whole_chunk:
                        _read_range(null, fd, 0, start)
                finally:
                    os.close(fd)


def _read_range(null: int, fd: int, offset: int, end: int | None) -> None:
    """Read `fd` from `offset` to `end` (None: its end) in PIECE steps."""
    while end is None or offset < end:
        piece = PIECE if end is None else min(PIECE, end - offset)
        sent = os.sendfile(null, fd, offset, piece)
        if sent <= 0:
            return
        offset += sent


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def prefetch_decision(mode: str, pooled: bool, throttled: bool, dataset_bytes: int,
                      memory: int) -> tuple[bool, str]:
    """(prefetch?, why) for a mount: see the module docstring."""
    if mode == "off":
        return False, "switched off (--prefetch off)"
    if pooled:
        return False, "off with a chunk pool (staging reads each node's share instead)"
    if throttled:
        return False, "off with a throttled store (benchmarks measure the store)"
    if dataset_bytes * MEMORY_SHARE > memory:
        return False, (f"off: the datasets ({dataset_bytes >> 20} MiB) exceed a quarter of "
                       f"the available memory ({memory >> 20} MiB)")
    return True, ("on: each chunk is read whole on its first sample read, a large file "
                  "a chunk size ahead of its reader (datasets "
                  f"{dataset_bytes >> 20} MiB, available memory {memory >> 20} MiB)")

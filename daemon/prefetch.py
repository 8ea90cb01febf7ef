"""ChunkPrefetch: pull a whole chunk file into the page cache when one of its samples is read.

Why: an epoch reads samples in random order, each a small random read of some
chunk file; the same bytes read as whole chunks are sequential I/O, which a
disk or a parallel file system delivers many times faster. So the first time
any sample of a chunk is read from the store, the whole chunk is queued to be
read start to end in the background, and the epoch's later samples from that
chunk hit the page cache. One stream per process, chunk after chunk: asking
the kernel for all of them at once (posix_fadvise WILLNEED) flooded the disk
queue and made the epoch's own reads wait (1,511 files/s instead of 2,336
without prefetch, bench/random_read.py tree, cold).

Only where it pays and fits (see `prefetch_decision`): single-node mounts
(with a chunk pool, staging does this for the node's own share, and pulling
every chunk to every node would multiply the store's load), and only when
the mounted datasets fit in a quarter of the memory available at mount time
(their bytes can sit in the page cache twice: chunk files and mounted files).
`dlfs mount --prefetch off` switches it off.

One byte per chunk in a shared mapping says it was asked for already (by any
process of the mount); the reads run on one daemon thread per process,
started lazily so forked workers get their own.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading

MEMORY_SHARE = 4  # prefetch only if datasets <= available memory / MEMORY_SHARE
PIECE = 1 << 20  # bytes per sendfile call: small, so the epoch's own reads get turns


class ChunkPrefetch:
    """Reads a chunk file whole into the page cache, once per chunk per mount."""

    def __init__(self, chunk_count: int) -> None:
        self._asked = mmap.mmap(-1, max(1, chunk_count))  # shared with forked workers
        self._queue: queue.SimpleQueue[tuple[int, int]] | None = None
        self._pid = 0

    def touch(self, fd: int, chunk: int, pos: int = 0) -> None:
        """A sample of `chunk` (open as `fd`) is being read from the store at `pos`."""
        if self._asked[chunk]:
            return
        self._asked[chunk] = 1
        if self._pid != os.getpid():  # first use in this process (workers are forked)
            self._pid = os.getpid()
            self._queue = queue.SimpleQueue()
            threading.Thread(target=_read_forever, args=(self._queue,),
                             name="dlfs-prefetch", daemon=True).start()
        self._queue.put((fd, pos - pos % PIECE))

    def close(self) -> None:
        self._asked.close()


def _read_forever(fds: queue.SimpleQueue[tuple[int, int]]) -> None:
    """Read each queued chunk file whole, one at a time (a sequential stream), into
    the page cache: from the touched offset to the end, then from the start up to
    it. sendfile to /dev/null moves no bytes through user space."""
    null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    while True:
        fd, start = fds.get()
        with contextlib.suppress(OSError):  # closed at unmount meanwhile: nothing to do
            _read_range(null, fd, start, None)
            _read_range(null, fd, 0, start)


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
    return True, (f"on: each chunk is read whole on its first sample read (datasets "
                  f"{dataset_bytes >> 20} MiB, available memory {memory >> 20} MiB)")

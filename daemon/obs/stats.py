"""Stats: Darshan-style I/O counters per mount, per dataset and per file. Always on.

Everything lives in ONE anonymous shared mmap made before the daemon forks its
workers, so every process adds into the same memory:

* per-file counters (opens, reads, bytes, first/last access, the end offset
  of the last read): one copy, 40 bytes per file, updated under one of 64
  striped process-shared locks (uncontended: ~0.15 us; two processes only
  meet on a stripe when they serve the same file at the same moment, or 1 in
  64 by chance). Per-process copies would cost processes x files of memory.
  A dataset's opens, reads and bytes are sums over its files (at snapshot).
* per-dataset counters (sequential reads, latency sum, per-source
  bytes/reads/latency, log2 request-size and latency histograms): one slab per
  process (see dlfsd.base.slots). A process only ever writes its own slab, so
  nothing is lost between processes without any lock; `snapshot()` sums the
  slabs. Mount totals are the sum of the datasets.

The hot path does about ten integer updates through `memoryview`s (numpy
scalar arithmetic is 2-3x slower), allocates nothing and never logs. `numpy`
views of the same memory serve `snapshot()`.

A read is sequential if it starts where the previous read of the same file
ended (the last end offset is reset to 0 by each open, so reading a file from
its start is sequential); otherwise it is random.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import time
from collections.abc import Sequence
from time import monotonic_ns

import numpy as np

from dlfs.store.directory import SampleDirectory, display_path
from dlfsd.base.slots import ProcessSlot

SOURCE_LOCAL = 0
SOURCE_PEER = 1
SOURCE_STORE = 2
SOURCE_NAMES = ("local", "peer", "store")

STATS_FORMAT_VERSION = 1
BUCKETS = 32  # log2 buckets: bucket b counts values v with v.bit_length() == b (last: >=)
TOP_FILES = 10  # files per dataset listed in a snapshot (by bytes read)
LOCK_STRIPES = 64

# Per-dataset counter layout (int64) inside a process slab.
SEQ_READS, LATENCY_SUM = range(2)
SRC_BYTES = 2
SRC_READS = SRC_BYTES + len(SOURCE_NAMES)
SRC_LATENCY = SRC_READS + len(SOURCE_NAMES)
SIZE_HIST = SRC_LATENCY + len(SOURCE_NAMES)
LATENCY_HIST = SIZE_HIST + BUCKETS
AHEAD_HITS = LATENCY_HIST + BUCKETS  # reads of extents the look-ahead fetched first
AHEAD_MISSES = AHEAD_HITS + 1  # reads while it followed an epoch, of extents it had not
# Local reads served from copies an earlier mount staged (the node cache: ChunkCache.is_adopted).
ADOPTED_BYTES = AHEAD_MISSES + 1
ADOPTED_READS = ADOPTED_BYTES + 1
STRIDE = ADOPTED_READS + 1

COUNT_MAX = 0xFFFFFFFF  # per-file opens and reads are 32-bit: they stop there
_FILE_FIELDS = (("opens", "I"), ("reads", "I"), ("bytes", "q"), ("last_end", "q"),
                ("first_ns", "q"), ("last_ns", "q"))  # times: monotonic ns since mount, 0 = never


class Stats:
    """Counters for the datasets of one mount; see the module doc for the layout."""

    enabled = True

    def __init__(self, names: Sequence[str], directories: Sequence[SampleDirectory],
                 slot: ProcessSlot) -> None:
        self.names = list(names)
        self.directories = list(directories)
        self.slot = slot
        self.mounted_ns = time.time_ns()
        self.opens_counted = True  # False: the kernel opens files without us (FUSE no_open)
        self._t0 = monotonic_ns() - 1  # so that no access time is ever 0 (0 = never)
        self._file_base = [0]
        for d in self.directories:
            self._file_base.append(self._file_base[-1] + len(d))
        files = self._file_base[-1]
        slab_words = len(self.names) * STRIDE
        slab_bytes = slab_words * 8 * slot.count
        offsets, size = [slab_bytes], slab_bytes
        for _, code in _FILE_FIELDS:
            size = -(-size // 8) * 8
            offsets.append(size)
            size += files * (4 if code == "I" else 8)
        self._mm = mmap.mmap(-1, max(size, 1))  # anonymous + shared: forked workers see it
        self._slabs = np.frombuffer(self._mm, np.int64, slot.count * slab_words).reshape(
            slot.count, len(self.names), STRIDE)
        self._files = {}
        views = []
        for (name, code), off in zip(_FILE_FIELDS, offsets[1:], strict=True):
            dtype = np.uint32 if code == "I" else np.int64
            self._files[name] = np.frombuffer(self._mm, dtype, files, off)
            views.append(memoryview(self._mm)[off : off + files * dtype().itemsize].cast(code))
        (self._fopens, self._freads, self._fbytes, self._last_end,
         self._first, self._last) = views
        self._all_slabs = memoryview(self._mm)[:slab_bytes].cast("q")
        self._slab_words = slab_words
        self._slab = self._all_slabs[:slab_words]
        slot.on_change(self._use_slab)
        self._locks = [multiprocessing.Lock() for _ in range(LOCK_STRIPES)]
        self.request_sources = 0  # bit mask of sources the current read used (for the trace)

    def close(self) -> None:
        """Drop the views and the mapping (main process, after the workers stopped)."""
        views = (self._fopens, self._freads, self._fbytes, self._last_end, self._first,
                 self._last, self._slab, self._all_slabs)
        self._slabs = None
        self._files = {}
        for view in views:
            view.release()
        with contextlib.suppress(BufferError):  # a snapshot array still holds it: dies with us
            self._mm.close()

    def _use_slab(self, index: int) -> None:
        """Write into slab `index` from now on (called in a worker right after fork)."""
        start = index * self._slab_words
        self._slab = self._all_slabs[start : start + self._slab_words]

    # -- the hot path -------------------------------------------------------------
    def record_open(self, ds: int, row: int) -> None:
        """An open of file `row` of dataset `ds` (resets its sequential-read detector)."""
        f = self._file_base[ds] + row
        now = monotonic_ns() - self._t0
        lock = self._locks[f & (LOCK_STRIPES - 1)]
        lock.acquire()  # not `with`: half the cost; try/finally is free in 3.11
        try:
            if self._fopens[f] != COUNT_MAX:  # saturate: past it the += would raise
                self._fopens[f] += 1
            self._last_end[f] = 0
            if not self._first[f]:
                self._first[f] = now
            self._last[f] = now
        finally:
            lock.release()

    def record_read(self, ds: int, row: int, offset: int, size: int, latency_ns: int) -> None:
        """One read request answered with `size` bytes at `offset` after `latency_ns`."""
        f = self._file_base[ds] + row
        now = monotonic_ns() - self._t0
        lock = self._locks[f & (LOCK_STRIPES - 1)]
        lock.acquire()
        try:
            sequential = offset == 0 or self._last_end[f] == offset
            self._last_end[f] = offset + size
            if self._freads[f] != COUNT_MAX:  # (2**32 reads of one file: a day at 50k/s)
                self._freads[f] += 1
            self._fbytes[f] += size
            if not self._first[f]:  # no open seen (the kernel opened it: FUSE no_open)
                self._first[f] = now
            self._last[f] = now
        finally:
            lock.release()
        slab = self._slab
        base = ds * STRIDE
        slab[base + LATENCY_SUM] += latency_ns
        slab[base + SIZE_HIST + min(size.bit_length(), BUCKETS - 1)] += 1
        slab[base + LATENCY_HIST + min((latency_ns // 1000).bit_length(), BUCKETS - 1)] += 1
        if sequential:
            slab[base + SEQ_READS] += 1

    def record_source(self, ds: int, source: int, nbytes: int, latency_ns: int) -> None:
        """`nbytes` of dataset `ds` came from `source` (SOURCE_LOCAL/PEER/STORE)."""
        slab = self._slab
        base = ds * STRIDE
        slab[base + SRC_BYTES + source] += nbytes
        slab[base + SRC_READS + source] += 1
        slab[base + SRC_LATENCY + source] += latency_ns
        self.request_sources |= 1 << source

    def record_lookahead(self, ds: int, hit: bool) -> None:
        """A read while the look-ahead follows an epoch: its extent was fetched ahead or not."""
        self._slab[ds * STRIDE + (AHEAD_HITS if hit else AHEAD_MISSES)] += 1

    def record_adopted(self, ds: int, nbytes: int) -> None:
        """A local read (counted by record_source too) came from a copy an earlier mount
        staged: a cache hit from an earlier job."""
        slab = self._slab
        base = ds * STRIDE
        slab[base + ADOPTED_BYTES] += nbytes
        slab[base + ADOPTED_READS] += 1

    # -- reading ------------------------------------------------------------------
    def snapshot(self, top_files: int = TOP_FILES) -> dict:
        """All counters as a JSON-able dict (slabs summed); see docs/STATS.md."""
        totals = self._slabs.sum(axis=0)
        datasets = {}
        for k, name in enumerate(self.names):
            datasets[name] = self._dataset_snapshot(k, totals[k], top_files)
        mount = _counters(totals.sum(axis=0), *(
            sum(d[key] for d in datasets.values()) for key in ("opens", "reads", "bytes")))
        mount["files_touched"] = sum(d["files_touched"] for d in datasets.values())
        times = [d[key] for d in datasets.values() for key in ("first_access_ns",
                                                               "last_access_ns") if d[key]]
        mount["first_access_ns"] = min(times) if times else 0
        mount["last_access_ns"] = max(times) if times else 0
        return {"format": "dlfs-stats", "version": STATS_FORMAT_VERSION, "enabled": True,
                "time_ns": time.time_ns(), "mounted_ns": self.mounted_ns,
                "processes": self.slot.count, "opens_counted": self.opens_counted,
                "sources": list(SOURCE_NAMES),
                "buckets": "log2: bucket b counts values v with v.bit_length() == b "
                           "(sizes in bytes, latencies in microseconds); the last is open",
                "mount": mount, "datasets": datasets}

    def sources(self) -> dict:
        """{dataset: {source: {bytes, reads, latency_ns_sum}}}: the cheap part of a snapshot
        (slab sums only), for the status file the daemon rewrites every second."""
        totals = self._slabs.sum(axis=0)
        return {name: _counters(totals[k], 0, 0, 0)["sources"]
                for k, name in enumerate(self.names)}

    def adopted(self) -> dict:
        """{dataset: {bytes, reads}} read from copies earlier mounts staged (status file)."""
        totals = self._slabs.sum(axis=0)
        return {name: {"bytes": int(totals[k][ADOPTED_BYTES]),
                       "reads": int(totals[k][ADOPTED_READS])}
                for k, name in enumerate(self.names)}

    def _dataset_snapshot(self, k: int, counts: np.ndarray, top_files: int) -> dict:
        lo, hi = self._file_base[k], self._file_base[k + 1]
        # A copy: other processes keep writing, and numpy refuses arrays that change under it.
        files = {name: array[lo:hi].copy() for name, array in self._files.items()
                 if name != "last_end"}  # (the read detector's state: not reported)
        touched = np.flatnonzero(files["first_ns"])
        out = _counters(counts, int(files["opens"].sum(dtype=np.int64)),
                        int(files["reads"].sum(dtype=np.int64)),
                        int(files["bytes"].sum(dtype=np.int64)))
        out["files_touched"] = int(touched.size)
        out["first_access_ns"] = self._wall(int(files["first_ns"][touched].min())) \
            if touched.size else 0
        out["last_access_ns"] = self._wall(int(files["last_ns"][touched].max())) \
            if touched.size else 0
        out["top_files"] = self._top_files(k, files, touched, top_files)
        return out

    def _top_files(self, k: int, files: dict, touched: np.ndarray, count: int) -> list[dict]:
        if not touched.size or count <= 0:
            return []
        rows = top_rows(touched, files["bytes"][touched], count)
        return [{"path": display_path(self.directories[k].path(int(row))),
                 "opens": int(files["opens"][row]), "reads": int(files["reads"][row]),
                 "bytes": int(files["bytes"][row]),
                 "first_access_ns": self._wall(int(files["first_ns"][row])),
                 "last_access_ns": self._wall(int(files["last_ns"][row]))} for row in rows]

    def _wall(self, since_mount_ns: int) -> int:
        """A monotonic time since mount as wall-clock ns (0 stays 0: never)."""
        return self.mounted_ns + since_mount_ns if since_mount_ns else 0


def top_rows(rows: np.ndarray, nbytes: np.ndarray, count: int) -> np.ndarray:
    """The `count` rows with the most bytes, most first, ties by row (`rows` ascending).

    Found in O(n), then only those sorted: a million touched files must not cost a
    full sort on every read of `.dlfs/stats.json`.
    """
    candidates = np.arange(rows.size)
    if rows.size > count:
        kth = np.partition(nbytes, rows.size - count)[rows.size - count]
        candidates = np.flatnonzero(nbytes >= kth)
    order = candidates[np.lexsort((rows[candidates], -nbytes[candidates]))]
    return rows[order[:count]]


def _counters(c: np.ndarray, opens: int, reads: int, nbytes: int) -> dict:
    """The summed slab counters `c` of a dataset (or mount) plus its file totals."""
    return {
        "opens": opens, "reads": reads, "bytes": nbytes,
        "sequential_reads": int(c[SEQ_READS]), "random_reads": max(reads - int(c[SEQ_READS]), 0),
        "read_latency_ns_sum": int(c[LATENCY_SUM]),
        "read_size_hist": [int(v) for v in c[SIZE_HIST : SIZE_HIST + BUCKETS]],
        "read_latency_us_hist": [int(v) for v in c[LATENCY_HIST : LATENCY_HIST + BUCKETS]],
        "sources": {name: {"bytes": int(c[SRC_BYTES + i]), "reads": int(c[SRC_READS + i]),
                           "latency_ns_sum": int(c[SRC_LATENCY + i])}
                    for i, name in enumerate(SOURCE_NAMES)},
        "lookahead": {"hits": int(c[AHEAD_HITS]), "misses": int(c[AHEAD_MISSES])},
        "adopted": {"bytes": int(c[ADOPTED_BYTES]), "reads": int(c[ADOPTED_READS])},
    }


class NullStats:
    """Stand-in when counters are off (`--no-stats`): same calls, nothing recorded."""

    enabled = False
    request_sources = 0

    def record_open(self, ds: int, row: int) -> None:
        pass

    def record_read(self, ds: int, row: int, offset: int, size: int, latency_ns: int) -> None:
        pass

    def record_source(self, ds: int, source: int, nbytes: int, latency_ns: int) -> None:
        pass

    def record_lookahead(self, ds: int, hit: bool) -> None:
        pass

    def record_adopted(self, ds: int, nbytes: int) -> None:
        pass

    def sources(self) -> dict:
        return {}

    def adopted(self) -> dict:
        return {}

    def snapshot(self, top_files: int = TOP_FILES) -> dict:
        return {"format": "dlfs-stats", "version": STATS_FORMAT_VERSION, "enabled": False,
                "time_ns": time.time_ns()}

    def close(self) -> None:
        pass

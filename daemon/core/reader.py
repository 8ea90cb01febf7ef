"""SampleReader: file bytes of one dataset, read from its chunk files.

Where the bytes come from is dlfsd.core.extentsource's plan, which the look-ahead
follows too: with a chunk pool (cluster mode), a chunk staged on local NVMe
is read there, else from an owner peer (the extent's byte range, checked
against its checksum), else from the store (and the chunk is demanded from
the stager if this node owns it). Without a pool, from the store only. An
extent the look-ahead read ahead from the store (AHEAD) comes from the
store's page cache first.

Every call is blocking and synchronous: the worker processes that serve FUSE
handle one request at a time each (see dlfsd.main), the libfuse multi-thread
model, so a read just reads. Each extent's checksum is checked the first time
it is read; workers whose first reads of one extent coincide wait for the one
that loads it (STORE_LOADING) and peer fetches are shared by the node's
processes (dlfsd.pool.peershare). Wrong bytes never leave this class.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import time
from typing import TYPE_CHECKING

from dlfs.errors import CorruptDataError
from dlfs.store.directory import display_path
from dlfs.store.format import CHUNK_HEADER_SIZE, checksum
from dlfs.store.store import Dataset
from dlfsd.base.throttle import pace
from dlfsd.core.extentsource import DEMAND, TRY_LOCAL, TRY_PEER, ExtentSource, ReaderPool
from dlfsd.core.prefetch import ChunkPrefetch
from dlfsd.core.values import FileSpan
from dlfsd.obs.stalls import NO_REQUESTS, WAIT_LOCAL, WAIT_STORE
from dlfsd.obs.stats import SOURCE_LOCAL, SOURCE_PEER, SOURCE_STORE, NullStats
from dlfsd.pool.peershare import extent_key

if TYPE_CHECKING:
    from dlfsd.obs.stalls import NullRequests, RequestSlots
    from dlfsd.obs.stats import Stats

log = logging.getLogger(__name__)

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
_populate_read = True  # cleared if the kernel lacks MADV_POPULATE_READ

# Per-extent state bits, shared by all processes of the mount.
STORE_OK = 1  # the store copy was read whole and matched its checksum
LOCAL_OK = 2  # the staged copy on local NVMe did
STORE_BAD = 4  # the store copy did not (logged once)
STORE_LOADING = 8  # a worker process is loading and checking the store copy right now
AHEAD = 16  # the look-ahead read the store copy into the page cache and checked it
PEER_AHEAD = 64  # the look-ahead fetched it from a peer into the node's PeerShare
LOADING_WAIT = 2.0  # seconds a worker waits for another one's load before loading itself
#: Reads at least this large of verified bytes may be answered as a FileSpan (the
#: worker splices them into its reply). Measured on re-reads of verified files with
#: the chunk files cached: 1 MiB reads +30% (2,150 -> 2,800 MiB/s); 512 KiB -8%,
#: 110 KiB -15% (the extra system call and per-page pipe work cost more than the copy).
SPAN_MIN = 1 << 20
#: Extents at least this large are checked in place (mmap) on a first read that does
#: not need all their bytes in hand (a spliced or partial read). Daemon CPU for a cold
#: 584 MiB sequential pass, spliced: 0.24-0.25 s in place vs 0.32-0.65 s copied out.
MAP_HASH_MIN = 1 << 20


class SampleReader:
    """Reads (row, offset, size) of one dataset; verifies extents on first touch."""

    def __init__(self, dataset: Dataset, verify: bool = True, pool: ReaderPool | None = None,
                 ds_index: int = 0, store_rate: int = 0, prefetch: bool = False) -> None:
        self.dataset = dataset
        self.directory = dataset.directory
        # Where extents come from and the descriptors to read them (shared with the
        # look-ahead, which fetches through the same plan).
        self.source = ExtentSource(dataset, pool, ds_index)
        # One byte of state bits per extent in an anonymous shared mapping, so
        # worker processes forked later share it: an extent is verified once per
        # copy per mount and a corrupt one logged once.
        self._state = mmap.mmap(-1, max(1, self.directory.extent_count))
        if not verify:
            self._state.write(bytes([STORE_OK | LOCAL_OK]) * self.directory.extent_count)
        # A byte per extent, set when a reader read it since the look-ahead was told of
        # it (the look-ahead moves by these): a mapping of its own, written with plain
        # stores. As a bit of the state byte, the look-ahead's concurrent `|= AHEAD`
        # from another process could write back a byte read before the mark, losing it,
        # and the look-ahead's window stopped at the lost mark for the rest of the epoch.
        self._taken = mmap.mmap(-1, max(1, self.directory.extent_count))
        self._unusable_copies: set[int] = set()  # staged copies that failed to open: logged
        self._store_rate = store_rate
        d = self.directory
        self._ext_chunk, self._ext_off, self._ext_len = (
            d.ext_chunk_view, d.ext_offset_view, d.ext_length_view)
        self._ext_sum = d.ext_checksum_view
        self.ds = ds_index
        self.stats: Stats | NullStats = NullStats()  # the Namespace sets the mount's counters
        # and the stall detector's slots (source being tried)
        self.requests: RequestSlots | NullRequests = NO_REQUESTS
        self.pool = pool
        # What a pooled read uses, kept only where it is there (the plan says which
        # sources exist: TRY_LOCAL needs a pool, TRY_PEER other nodes, so a share).
        if pool is not None:
            self._pool = pool
            self._cache = pool.caches[ds_index]
            self._by_chunk = d.extents_by_chunk(dataset.chunk_count)
            if pool.share is not None:
                self._share = pool.share
        self._prefetch = ChunkPrefetch(
            dataset.chunk_count, dataset.chunk_size, d.extent_size, self._ext_chunk,
            self._ext_off, self._ext_len, dataset.chunk_path) if prefetch else None
        self._span = FileSpan()  # what a read of verified bytes returns, if use_spans
        self._span_max = 0  # (0: never)
        self._lookahead = _NO_LOOKAHEAD  # [0] is 1 while the look-ahead follows an epoch

    # Read-only views for the look-ahead (dlfsd.core.lookahead), which fetches extents itself.
    @property
    def state_map(self) -> mmap.mmap:
        return self._state

    @property
    def taken_map(self) -> mmap.mmap:
        return self._taken

    @property
    def ext_chunks(self) -> memoryview:
        return self._ext_chunk

    @property
    def ext_offsets(self) -> memoryview:
        return self._ext_off

    @property
    def ext_lengths(self) -> memoryview:
        return self._ext_len

    @property
    def ext_checksums(self) -> memoryview:
        return self._ext_sum

    def follow_lookahead(self, flag) -> None:
        """Mark extents taken and take AHEAD ones while `flag[0]` is set (a shared byte)."""
        self._lookahead = flag

    def use_spans(self, max_length: int) -> None:
        """From now on a read of verified bytes from one chunk file, SPAN_MIN up to
        `max_length` long, may return a FileSpan (reused: consume it before the next
        read) instead of the bytes. 0: never."""
        self._span_max = max_length

    def close(self) -> None:
        self._state.close()
        self._taken.close()
        if self._prefetch is not None:
            self._prefetch.close()
        self.source.close_store_fds()

    def read(self, row: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        """Up to `size` bytes of file `row` at `offset` (short at end of file)."""
        file_size = self.directory.size(row)
        end = min(offset + size, file_size)
        if offset >= end:
            return b""
        piece = self.directory.extent_size
        base = self.directory.first_extent(row)
        first = offset // piece
        last = (end - 1) // piece
        if self._prefetch is not None:
            self._prefetch.touch(base + first, offset - first * piece,
                                 base + (file_size - 1) // piece, file_size)
        if first == last:
            return self._read_extent(base + first, offset - first * piece, end - offset,
                                           self._span_max > 0)
        parts = []
        for i in range(first, last + 1):
            lo = max(offset, i * piece) - i * piece
            hi = min(end, (i + 1) * piece) - i * piece
            parts.append(self._read_extent(base + i, lo, hi - lo, False, lasting=True))
        return b"".join(parts)

    def _read_extent(self, ext: int, rel: int, length: int, span: bool,
                           lasting: bool = False):
        """`span`: the bytes may be returned as a FileSpan if verified already (never
        from a throttled store: the pacing is in the reads). `lasting`: they must stay
        valid across further reads (a peer's may be a view of its client's buffer)."""
        span = span and SPAN_MIN <= length <= self._span_max and not self._store_rate
        if self._lookahead[0]:
            data = self._read_ahead(ext, rel, length)
            if data is not None:
                return data
        if self.pool is not None:
            data = self._read_pooled(ext, rel, length, span, lasting)
            if data is not None:
                return data
        started = time.perf_counter_ns()
        self.requests.waiting(WAIT_STORE)
        data = self._read_store(ext, rel, length, span)
        self.stats.record_source(self.ds, SOURCE_STORE, length, time.perf_counter_ns() - started)
        return data

    def _read_ahead(self, ext: int, rel: int, length: int):
        """Mark the extent taken (the look-ahead moves by it); if the look-ahead fetched
        it, read it from the store copy's page cache, unpaced; else None."""
        self._taken[ext] = 1
        state = self._state[ext]
        if not state & AHEAD:
            # fetched from a peer ahead: the pooled read below finds it in PeerShare
            self.stats.record_lookahead(self.ds, bool(state & PEER_AHEAD))
            return None
        started = time.perf_counter_ns()
        self.requests.waiting(WAIT_STORE)
        fd = self.source.store_fd(self._ext_chunk[ext])
        data = _pread_exact(fd, length, CHUNK_HEADER_SIZE + self._ext_off[ext] + rel)
        if rel + length >= self._ext_len[ext]:
            self._state[ext] &= ~AHEAD & 0xFF  # taken whole: the next read pays again
        self.stats.record_lookahead(self.ds, True)
        self.stats.record_source(self.ds, SOURCE_STORE, length, time.perf_counter_ns() - started)
        return data

    def _read_store(self, ext: int, rel: int, length: int, span: bool):
        if not self._state[ext] & STORE_OK:
            self._wait_for_other_load(ext)
        if not self._state[ext] & STORE_OK:
            # Check a large extent where it lies (mapped) when this read does not need
            # all of its bytes in hand: copying 4 MiB out to answer a 1 MiB read (or to
            # splice it) costs more than mapping. A small extent costs less to copy.
            whole = self._ext_len[ext]
            in_place = whole >= MAP_HASH_MIN and (span or length < whole) \
                and not self._store_rate
            data = self._load_verified(ext, keep=not in_place)
            if not in_place:
                return _slice(data, rel, length)
        pos = CHUNK_HEADER_SIZE + self._ext_off[ext] + rel
        fd = self.source.store_fd(self._ext_chunk[ext])
        if span:
            return self._span.set(fd, pos, length)
        if self._store_rate:
            return _pread_paced(fd, length, pos, self._store_rate)
        return _pread_exact(fd, length, pos)

    # -- the chunk pool: local NVMe, then peers -----------------------------------------
    def _read_pooled(self, ext: int, rel: int, length: int, span: bool,
                           lasting: bool):
        """From the staged copy or an owner peer, as the source's plan says; None: go to
        the store."""
        chunk = self._ext_chunk[ext]
        plan = self.source.plan(chunk)
        started = time.perf_counter_ns()
        if plan & TRY_LOCAL:
            self.requests.waiting(WAIT_LOCAL)
            data = self._read_local(ext, rel, length, chunk, span)
            if data is not None:
                self._count(SOURCE_LOCAL, length, started)
                if self._cache.is_adopted(chunk):  # a hit from an earlier job's staging
                    self.stats.record_adopted(self.ds, length)
                return data
        if plan & TRY_PEER:
            data = self._read_peer(ext, rel, length, chunk, lasting)
            if data is not None:
                self._count(SOURCE_PEER, length, started)
                return data
        if plan & DEMAND:
            self.source.demand(chunk)  # we read it from the store: stage it next
        return None

    def _count(self, source: int, nbytes: int, started: int) -> None:
        self.stats.record_source(self.ds, source, nbytes, time.perf_counter_ns() - started)

    def _read_local(self, ext: int, rel: int, length: int, chunk: int, span: bool):
        try:
            fd = self._cache.fd(chunk)
        except OSError as err:  # out of descriptors, permissions, a failing NVMe
            self._local_open_failed(chunk, err)
            return None  # the read goes on to the peers or the store
        if fd < 0:
            return None
        if self._state[ext] & LOCAL_OK:
            pos = CHUNK_HEADER_SIZE + self._ext_off[ext] + rel
            if span:  # if the splice fails, the worker reads again without a span:
                return self._span.set(fd, pos, length)  # a bad copy is evicted then
            try:
                return _pread_exact(fd, length, pos)
            except (CorruptDataError, OSError) as err:  # truncated copy, failing NVMe
                self._evict(chunk, fd, str(err) or "unreadable")
                return None
        data = self._verify_local(ext, fd, chunk)
        return None if data is None else _slice(data, rel, length)

    def _verify_local(self, ext: int, fd: int, chunk: int) -> bytes | None:
        try:
            data, digest = _pread_and_hash(fd, self._ext_len[ext],
                                           CHUNK_HEADER_SIZE + self._ext_off[ext])
        except (CorruptDataError, OSError) as err:  # truncated copy, failing NVMe
            self._evict(chunk, fd, str(err) or "unreadable")
            return None
        if digest != self._ext_sum[ext]:
            self._evict(chunk, fd, "checksum mismatch")
            return None
        self._state[ext] |= LOCAL_OK
        return data

    def _local_open_failed(self, chunk: int, err: OSError) -> None:
        if chunk in self._unusable_copies:
            return
        self._unusable_copies.add(chunk)
        log.warning("cannot open staged chunk %d of dataset %s (%s: %s); reading it from "
                    "peers or the store instead", chunk, self.dataset.name,
                    self._cache.path(chunk), err.strerror)

    def _evict(self, chunk: int, fd: int, what: str) -> None:
        """The staged copy read through `fd` is bad: stop using it, clear its extents'
        marks, stage it again (if `fd` is still the current copy: ChunkPool.evict_copy)."""
        if not self._pool.evict_copy(self.ds, chunk, fd):
            return
        log.error("%s in staged chunk %d of dataset %s (%s); evicted, re-staging; reads "
                  "go to peers or the store", what, chunk, self.dataset.name,
                  self._cache.path(chunk))
        order, bounds = self._by_chunk
        for e in order[bounds[chunk] : bounds[chunk + 1]]:
            self._state[e] &= ~LOCAL_OK & 0xFF

    def _read_peer(self, ext: int, rel: int, length: int, chunk: int, lasting: bool):
        """From an owner: the node fetches the whole extent once (checked by the pool) and
        keeps it where its other processes find it (PeerShare) for their partial reads."""
        size = self._ext_len[ext]
        return self._share.read(extent_key(self.ds, ext), rel, length, lasting,
                                self._pool.fetch, self.ds, chunk, self._ext_off[ext],
                                size, self._ext_sum[ext], whole=length == size)

    def _wait_for_other_load(self, ext: int) -> None:
        """Worker processes: if another one is loading this extent, wait for its result.

        The kernel's read-ahead sends a large file's requests for one extent to
        several workers at once; without this each would read and hash the whole
        extent (up to 4 MiB) itself. A loader that dies leaves the mark behind:
        after LOADING_WAIT seconds we load it ourselves.
        """
        state = self._state
        if not state[ext] & STORE_LOADING:
            return
        deadline = time.monotonic() + LOADING_WAIT
        while state[ext] & STORE_LOADING and not state[ext] & STORE_OK:
            if time.monotonic() > deadline:
                return
            time.sleep(0.0002)

    def _load_verified(self, ext: int, keep: bool = True) -> bytes:
        """Load a whole extent and check it (STORE_LOADING meanwhile: other workers wait
        for it, see _wait_for_other_load).

        keep=False: only check it (hashed where it lies, no copy); returns b"".
        """
        self._state[ext] |= STORE_LOADING
        try:
            fd = self.source.store_fd(self._ext_chunk[ext])
            pos = CHUNK_HEADER_SIZE + self._ext_off[ext]
            try:
                if keep:
                    data, digest = _pread_and_hash(fd, self._ext_len[ext], pos,
                                                   self._store_rate)
                else:
                    data, digest = _map_and_hash(fd, self._ext_len[ext], pos)
            except CorruptDataError as err:
                self._report_corrupt(ext, str(err))
                raise
            if digest != self._ext_sum[ext]:
                self._report_corrupt(ext, "checksum mismatch")
                raise CorruptDataError(f"checksum mismatch in extent {ext}")
            self._state[ext] |= STORE_OK
            return data
        finally:
            self._state[ext] &= ~STORE_LOADING & 0xFF

    def _report_corrupt(self, ext: int, what: str) -> None:
        if self._state[ext] & STORE_BAD:
            return
        self._state[ext] |= STORE_BAD
        row = self.directory.row_of_extent(ext)
        log.error("%s: dataset %s, file %s, chunk %d (%s); reads return EIO",
                  what, self.dataset.name, display_path(self.directory.path(row)),
                  self._ext_chunk[ext], self.dataset.chunk_path(self._ext_chunk[ext]))


def _pread_exact(fd: int, length: int, pos: int) -> bytes:
    data = os.pread(fd, length, pos)
    if len(data) != length:
        raise CorruptDataError(f"chunk file is truncated at offset {pos}")
    return data


def _pread_paced(fd: int, length: int, pos: int, rate: int) -> bytes:
    started = time.monotonic()
    data = _pread_exact(fd, length, pos)
    pace(rate, length, started)
    return data


def _pread_and_hash(fd: int, length: int, pos: int, rate: int = 0) -> tuple[bytes, int]:
    data = _pread_paced(fd, length, pos, rate) if rate else _pread_exact(fd, length, pos)
    return data, checksum(data)


def _map_and_hash(fd: int, length: int, pos: int) -> tuple[bytes, int]:
    """The checksum of `length` bytes at `pos`, hashed in place (mapped, not copied).

    Saves copying a whole extent out of the page cache when the read at hand
    needs only part of it, or splices it. Never used with a throttled store
    (its pacing is in the copying reads).

    Touching a mapped page the file system cannot deliver (file cut short, an
    I/O error, a stale NFS handle) would kill the process with SIGBUS, so the
    pages are faulted in first with MADV_POPULATE_READ, which reports such a
    failure as an error instead (Linux >= 5.14; elsewhere the bytes are copied
    out as before). The size is checked before mapping.
    """
    global _populate_read
    if pos + length > os.fstat(fd).st_size:
        raise CorruptDataError(f"chunk file is truncated at offset {pos}")
    if length == 0 or not _populate_read:
        return b"", _pread_and_hash(fd, length, pos)[1]
    start = pos - pos % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(fd, pos + length - start, mmap.MAP_SHARED, mmap.PROT_READ,
                           offset=start)
    except OSError:  # a chunk file system that cannot map files (ENODEV): copy out
        return b"", _pread_and_hash(fd, length, pos)[1]
    try:
        try:
            # Ask for the extent's pages at once: faulting them in alone reads
            # around each missing page, one 1 MiB disk request after the other.
            with contextlib.suppress(OSError):  # only a hint
                os.posix_fadvise(fd, pos, length, os.POSIX_FADV_WILLNEED)
            mapped.madvise(_MADV_POPULATE_READ)
        except OSError as err:
            if err.errno == errno.EFAULT:  # what a page the file system failed to deliver
                # gives (an I/O error: it would have been SIGBUS); answer as a pread would
                raise OSError(errno.EIO, f"cannot read chunk file pages at offset {pos}") \
                    from None
            if err.errno != errno.EINVAL:
                raise
            _populate_read = False  # an older kernel: copy out instead, from now on
            return b"", _pread_and_hash(fd, length, pos)[1]
        with memoryview(mapped) as view:
            return b"", checksum(view[pos - start :])
    finally:
        mapped.close()


def _slice(data, rel: int, length: int):
    return data if rel == 0 and length == len(data) else memoryview(data)[rel : rel + length]


_NO_LOOKAHEAD = b"\0"

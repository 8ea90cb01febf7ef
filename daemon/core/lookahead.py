"""LookAhead: read each announced epoch ahead of the processes that will read it.

A sampler (dlfs.order.sampler) registers its dataset's paths once and announces,
at the start of each epoch, the order its rank will read them in
(dlfs.order.wire). The daemon then fetches the samples' extents ahead of the
readers, in that order, on threads of the control process, never holding more
than `samples` samples or `nbytes` bytes fetched that no reader has taken yet,
nor reaching more than MAX_SPAN windows past the first sample not taken
(back-pressure: readers that fall behind stop the look-ahead, not the other way
round). How many samples it fetches at once
(its width: with a parallel file system, its read streams) follows the
readers: it starts at the low end of `streams` = (MIN, MAX) and opens more,
up to MAX, while its fetches are what holds it back and the readers are
close behind; it closes them again one by one while its window is full. More
readers read faster, so a fixed width fell behind them (8 fetches kept epoch
1 at 0.6-0.8 of the unannounced time with 8 DataLoader workers, 0.5 with 4).
Per extent:

- an extent whose chunk is staged on this node: its range of the staged copy
  is asked into the page cache (fadvise WILLNEED, asynchronous);
- a chunk this node owns but has not staged: demanded from the stager (so it
  stages in first-use order), and the extent is read from the store as below;
- a chunk only peers own: the whole extent is fetched from the first live
  owner that has it staged (checked, as every peer read is) into the node's
  PeerShare, where the reader that wants it finds it (marked PEER_AHEAD, for
  the hit count); an owner that has not staged it answers MISS and stages the
  chunk next. Staged nowhere: the readers would go to the store anyway, so it
  is read ahead as below. Each fetch thread has peer clients of its own
  (ChunkPool), so these fetches go in parallel, one per thread; within a
  thread's batch of samples, the peer extents go out together with
  `peer_pipeline` (ChunkPool.fetch_many pipelines those of one owner on one
  connection, counted in `peer_batches`; off by default: readers that outrun
  the look-ahead wait on its rounds), the per-extent way for the rest;
- otherwise the store: the whole extent is read (one paced stream per thread
  with a throttled store) and checked against its checksum; the extent is
  then marked STORE_OK | AHEAD in the readers' shared state, so the reader
  that takes it reads it from the page cache at once (and without pacing:
  the look-ahead's stream paid for it). An extent verified already and not
  throttled only gets WILLNEED.

Which of these an extent gets is the readers' own plan (dlfsd.core.extentsource,
`ahead=True`), read through the same descriptors, so the two agree.

Readers mark the extents they read taken (a shared byte per extent, apart from
the state bits) while any announcement is active (one shared flag byte: without
announcements the read path tests one byte).
The look-ahead moves its window by those marks; a stream whose readers take
nothing for `stale_seconds` (a killed job, an abandoned epoch) is dropped,
and so is the oldest one beyond MAX_STREAMS. Registrations are kept per
connection-independent handle, at most MAX_REGISTRATIONS (oldest dropped).
Memory stays bounded whatever clients do: besides those counts, what the
registrations and streams hold together (`held_bytes`) stays within
`memory_limit` (HELD_BYTES_PER_ENTRY per entry of the mount, at least
MIN_HELD_BYTES): past it the oldest streams, then the oldest registrations, are
dropped. The order socket's body limits (dlfsd.core.ordersock) keep any one of them
far below that limit.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dlfs.errors import DlfsError
from dlfs.sizes import format_size
from dlfs.store.format import CHUNK_HEADER_SIZE, checksum
from dlfsd.base.throttle import pace
from dlfsd.core.extentsource import DEMAND, TRY_LOCAL, TRY_PEER, ExtentSource, ReaderPool
from dlfsd.core.namespace import Namespace
from dlfsd.core.reader import AHEAD, PEER_AHEAD, STORE_OK, SampleReader
from dlfsd.pool.peershare import extent_key

if TYPE_CHECKING:
    from dlfs.cluster.nodes import ClusterView
    from dlfsd.pool.pool import ChunkPool

log = logging.getLogger(__name__)

MAX_STREAMS = 64  # announcements followed at once (ranks x DataLoaders of one node)
MAX_REGISTRATIONS = 32
STALE_SECONDS = 60.0
_TICK = 0.002  # seconds between scheduler passes when nothing changed
_BATCH = 8  # samples per fetch task beyond the front of the window
# How far past the slowest reader the window may reach, in windows: readers spread
# over the order, but a reader that stopped for good must not let it run on forever.
MAX_SPAN = 16
_ADJUST_SECONDS = 0.2  # how often the width follows the readers
# A fetch slower than this (per sample) waits on its source (a store stream, a peer):
# more fetches at once then go faster. Faster ones are the control process's CPU
# (page-cache copies, WILLNEED), which more threads only contend for.
SLOW_FETCH_SECONDS = 0.0005
NOT_ON_PEERS_SECONDS = 1.0  # a chunk no owner had staged is read from the store this long
# What registrations and streams may hold together, per entry of the mount: a
# registration costs 10 B per sample, a stream 26 B, and one job's samplers hold
# about one registration and one epoch per dataset: room for four of each.
HELD_BYTES_PER_ENTRY = 160
MIN_HELD_BYTES = 256 << 10  # a small mount still follows a few dozen epochs

# Counters (int64, written by the control process only; read by `.dlfs/` renders).
(ANNOUNCED, SAMPLES_AHEAD, BYTES_AHEAD, DEMANDED, DROPPED_STALE, DROPPED_FULL,
 FETCH_ERRORS, SKIPPED_PEER, PEER_FETCHES, PEER_BYTES, WIDTH, WIDENED, PEER_BATCHES) = range(13)
COUNTER_NAMES = ("announcements", "samples_prefetched", "bytes_prefetched",
                 "chunks_demanded", "streams_dropped_stale", "streams_dropped_full",
                 "fetch_errors", "extents_left_to_peers", "peer_fetches",
                 "bytes_prefetched_from_peers", "fetch_width", "fetch_width_grown",
                 "peer_batches")  # fetch_many calls: peer extents of a batch sent together


class AheadPool(ReaderPool, Protocol):
    """What the look-ahead needs of the chunk pool (ChunkPool) besides what a reader
    does: its own peer connections in the control process, who owns each chunk (the
    placement tables, the nodes) for `locality`, and several peer fetches at once."""

    @property
    def tables(self) -> Sequence[np.ndarray]: ...

    @property
    def view(self) -> ClusterView: ...

    def after_fork(self) -> None: ...

    def fetch_many(self, reads: Sequence[tuple[int, int, int, int, int]],
                   on_fetched: Callable[[int, bytes | memoryview | None], None]) -> None: ...


@dataclass
class Registration:
    """The paths one sampler registered, as (dataset, row) per sample."""

    ds: np.ndarray  # int16
    rows: np.ndarray  # int64, -1: not a file of this mount
    digest: bytes = b""  # of the registered path list: the ranks of a node send the same


@dataclass
class _Stream:
    """One announced epoch of one reader: positions [low, next) are in flight or ahead."""

    key: tuple[int, int]  # (handle, epoch)
    ds: np.ndarray
    rows: np.ndarray
    first: np.ndarray  # first extent of each sample
    ends: np.ndarray  # cumulative bytes: ends[i] = bytes of samples [0, i)
    next: int = 0
    low: int = 0
    progress_at: float = field(default_factory=time.monotonic)
    taken_at: float = float("-inf")  # when the readers last took a sample
    single: int = -1  # the dataset of every sample, when they share one (the usual case)


class LookAhead:
    """The look-ahead of one mount. Made before the daemon forks (the flag and the
    counters are shared memory); `start` runs it in the control process."""

    def __init__(self, namespace: Namespace, pool: AheadPool | None = None, samples: int = 256,
                 nbytes: int = 256 << 20, streams: tuple[int, int] = (8, 32),
                 store_rate: int = 0, stale_seconds: float = STALE_SECONDS,
                 peer_pipeline: bool = False, peer_ahead: bool = True) -> None:
        """`peer_pipeline`: a fetch thread's peer extents go out together (see the
        module's docstring); off: one prefetch each, the way before. `peer_ahead`
        False: extents only peers hold are left to the readers (`--lookahead-peers
        off`: where the node's CPU, not the peer's latency, is the bound)."""
        self.ns = namespace
        self.peer_pipeline = peer_pipeline
        self.peer_ahead = peer_ahead
        self.pool = pool
        # What a fetch from a peer uses, kept only where there are peers (as the
        # reader keeps it: a plan has TRY_PEER only then).
        if pool is not None:
            self._pool = pool
            if pool.share is not None:
                self._share = pool.share
        self.samples, self.nbytes = samples, nbytes
        self.width = Width(*streams)
        self.store_rate = store_rate
        self.stale_seconds = stale_seconds
        self._flag_map = mmap.mmap(-1, 1)
        self._counter_map = mmap.mmap(-1, 8 * len(COUNTER_NAMES))
        self.counters = np.frombuffer(self._counter_map, np.int64)
        self.counters[WIDTH] = self.width.now
        for reader in namespace.readers:
            reader.follow_lookahead(self._flag_map)
        self._states = [np.frombuffer(r.state_map, np.uint8) for r in namespace.readers]
        # what the readers took since the announcement, a byte per extent (taken_map)
        self._marks = [np.frombuffer(r.taken_map, np.uint8) for r in namespace.readers]
        self._registrations: OrderedDict[int, Registration] = OrderedDict()
        self._next_handle = 1
        self._streams: OrderedDict[tuple[int, int], _Stream] = OrderedDict()
        self._lock = threading.Condition()
        self._demanded: set[tuple[int, int]] = set()  # this announcement's, sent once
        # chunks no owner peer had staged, and until when to believe it (it stages them)
        self._not_on_peers: dict[tuple[int, int], float] = {}
        self._by_name = {r.dataset.name.encode(): k for k, r in enumerate(namespace.readers)}
        entries = sum(int(r.directory.arrays["mode"].size) for r in namespace.readers)
        self.memory_limit = max(MIN_HELD_BYTES, HELD_BYTES_PER_ENTRY * entries)
        self._inflight = 0
        self._samples_in_hand = 0  # samples of the batches submitted and not done yet
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._executor: ThreadPoolExecutor  # the fetch threads: made by start, with _thread

    # -- life ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler and fetch threads (in the control process, which opens
        peer connections of its own, as a worker does)."""
        if self.pool is not None:
            self.pool.after_fork()
        self._executor = ThreadPoolExecutor(self.width.most, thread_name_prefix="lookahead")
        self._thread = threading.Thread(target=self._schedule, name="lookahead", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:  # started: the executor is there too
            self._thread.join(5.0)
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._flag_map[0] = 0
        for reader in self.ns.readers:  # what its fetch threads opened in this process
            reader.source.close_store_fds()

    def close(self) -> None:
        """Drop the views of the readers' state (before the Namespace closes it)."""
        for reader in self.ns.readers:
            reader.follow_lookahead(b"\0")
        self._states, self._marks = [], []
        self.counters = np.zeros(len(COUNTER_NAMES), np.int64)
        for mapping in (self._flag_map, self._counter_map):
            with contextlib.suppress(BufferError):  # a snapshot still holds it: dies with us
                mapping.close()

    @property
    def active(self) -> bool:
        return bool(self._flag_map[0])

    # -- what samplers ask -----------------------------------------------------------
    def register_again(self, digest: bytes) -> tuple[int, Registration] | None:
        """A new handle for a path list registered before (same digest), sharing its
        resolved rows: every rank and every DataLoader worker of a node registers the
        same list, and resolving it once is enough. None if it is not (or no longer)
        registered."""
        with self._lock:
            known = next((r for r in self._registrations.values() if r.digest == digest),
                         None)
            return None if known is None or not digest else self._add(known)

    def registered_samples(self, handle) -> int | None:
        """How many samples registration `handle` has (None: no such registration):
        the order socket bounds an announcement by it before reading one."""
        with self._lock:
            registration = self._registrations.get(handle) if isinstance(handle, int) \
                else None
            return None if registration is None else int(registration.rows.size)

    def _add(self, registration: Registration) -> tuple[int, Registration]:
        """A handle for `registration`; the oldest are forgotten past MAX_REGISTRATIONS
        or the memory limit. Called with the lock held."""
        handle = self._next_handle
        self._next_handle += 1
        self._registrations[handle] = registration
        while len(self._registrations) > MAX_REGISTRATIONS:
            self._registrations.popitem(last=False)
        self._fit(keep=registration)
        return handle, registration

    def held_bytes(self) -> int:
        """What the registrations (each resolution once, however many handles share it)
        and the streams hold. Called with the lock held."""
        distinct = {id(r): r for r in self._registrations.values()}
        return (sum(r.ds.nbytes + r.rows.nbytes for r in distinct.values())
                + sum(s.ds.nbytes + s.rows.nbytes + s.first.nbytes + s.ends.nbytes
                      for s in self._streams.values()))

    def _fit(self, keep: object) -> None:
        """Drop the oldest streams, then the oldest registrations, until what they hold
        is within `memory_limit`; never `keep` (the one just added). Called with the
        lock held."""
        held = self.held_bytes()
        while held > self.memory_limit:
            stream = next((s for s in self._streams.values() if s is not keep), None)
            if stream is not None:
                del self._streams[stream.key]
                self.counters[DROPPED_FULL] += 1
                log.info("look-ahead: dropped epoch %d of registration %d (the look-ahead's "
                         "memory limit of %s is reached)", stream.key[1], stream.key[0],
                         format_size(self.memory_limit))
            else:
                mine = keep.key[0] if isinstance(keep, _Stream) else None
                handle = next((h for h, r in self._registrations.items()
                               if r is not keep and h != mine), None)
                if handle is None:
                    return  # `keep` alone: the body limits keep it far below the limit
                del self._registrations[handle]
                log.info("look-ahead: forgot registration %d (the look-ahead's memory limit "
                         "of %s is reached)", handle, format_size(self.memory_limit))
            held = self.held_bytes()

    def register(self, paths: list[bytes], digest: bytes = b"") -> tuple[int, Registration]:
        """Resolve relative paths ("dataset/rel/path") to (dataset, row); paths that are
        not regular files of this mount get row -1. In bulk, per dataset
        (SampleDirectory.resolve_many): the control process answers nothing else
        meanwhile, and a million paths take ~2 s this way against ~9 s path by path."""
        ds = np.zeros(len(paths), np.int16)
        rows = np.full(len(paths), -1, np.int64)
        by_dataset: dict[int, list[int]] = {}
        rests: list[bytes] = []
        for i, path in enumerate(paths):
            name, _, rest = path.strip(b"/").partition(b"/")
            rests.append(rest)
            k = self._by_name.get(name)
            if k is not None:
                by_dataset.setdefault(k, []).append(i)
        for k, members in by_dataset.items():
            directory = self.ns.readers[k].directory
            found = directory.resolve_many([rests[i] for i in members])
            regular = found >= 0
            modes = directory.arrays["mode"][np.where(regular, found, 0)]
            regular &= (modes & 0o170000) == stat.S_IFREG
            at = np.asarray(members)
            ds[at] = k
            rows[at] = np.where(regular, found, -1)
        with self._lock:
            return self._add(Registration(ds, rows, digest))

    def locality(self, registration: Registration) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(chunk key per sample, first node per chunk key, node count, this node)."""
        bases = np.cumsum([0] + [r.dataset.chunk_count for r in self.ns.readers])
        known = registration.rows >= 0
        keys = np.full(registration.rows.size, -1, np.int64)
        for k, reader in enumerate(self.ns.readers):
            mine = known & (registration.ds == k)
            if mine.any():
                arrays = reader.directory.arrays
                first = arrays["ext_start"][registration.rows[mine]]
                keys[mine] = bases[k] + arrays["ext_chunk"][first]
        if self.pool is None:
            return keys, np.zeros(int(bases[-1]), np.int32), 1, 0
        nodes = np.concatenate([t[:, 0] if t.shape[1] else np.full(t.shape[0], -1)
                                for t in self.pool.tables] or [np.zeros(0)]).astype(np.int32)
        return keys, nodes, len(self.pool.view.nodes), self.pool.view.self_index

    def announce(self, handle: int, epoch: int, order: np.ndarray) -> int:
        """Follow `order` (sample indices of registration `handle`) from now on."""
        with self._lock:
            registration = self._registrations.get(handle)
        if registration is None:
            raise DlfsError(unknown_registration(handle))
        if order.size and (order.min() < 0 or order.max() >= registration.rows.size):
            raise DlfsError(f"announced sample index out of range 0..{registration.rows.size - 1}")
        rows = registration.rows[order]
        keep = rows >= 0
        stream = self._stream((handle, epoch), registration.ds[order][keep], rows[keep])
        with self._lock:
            self._streams.pop(stream.key, None)
            for key in [k for k in self._streams if k[0] == handle]:
                del self._streams[key]  # the same reader's earlier epoch: abandoned
            self._streams[stream.key] = stream
            while len(self._streams) > MAX_STREAMS:
                self._streams.popitem(last=False)
                self.counters[DROPPED_FULL] += 1
            self._fit(keep=stream)
            self.counters[ANNOUNCED] += 1
            self._demanded.clear()
            self._not_on_peers.clear()  # copies come and go between epochs
            self._flag_map[0] = 1
            self._lock.notify_all()
        return int(stream.rows.size)

    def _stream(self, key: tuple[int, int], ds: np.ndarray, rows: np.ndarray) -> _Stream:
        first = np.zeros(rows.size, np.int64)
        sizes = np.zeros(rows.size, np.int64)
        for k, reader in enumerate(self.ns.readers):
            mine = ds == k
            if mine.any():
                arrays = reader.directory.arrays
                first[mine] = arrays["ext_start"][rows[mine]]
                sizes[mine] = arrays["size"][rows[mine]]
                # Marks of earlier epochs must not count in this one: on every extent of
                # the samples (a large file's later extents were marked too).
                extents = _extents_of(arrays["ext_start"], rows[mine])
                self._marks[k][extents] = 0
                self._states[k][extents] &= np.uint8(~PEER_AHEAD & 0xFF)
        ends = np.concatenate([[0], np.cumsum(sizes)])
        single = int(ds[0]) if ds.size and (ds == ds[0]).all() else -1
        return _Stream(key, ds, rows, first, ends, single=single)

    def status(self) -> dict:
        with self._lock:
            streams = [{"handle": s.key[0], "epoch": s.key[1], "samples": int(s.rows.size),
                        "taken": s.low, "fetched": s.next} for s in self._streams.values()]
            held = self.held_bytes()
        return {"streams": streams, "counters": self.counter_dict(), "held_bytes": held,
                "memory_limit": self.memory_limit, "width": self.width.now,
                "width_bounds": [self.width.least, self.width.most]}

    def counter_dict(self) -> dict:
        return {name: int(v) for name, v in zip(COUNTER_NAMES, self.counters, strict=True)}

    # -- the scheduler ---------------------------------------------------------------
    def _schedule(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                if not self._streams:
                    self._flag_map[0] = 0
                    self._lock.wait(1.0)
                    continue
                streams = list(self._streams.values())
            busy = False
            for stream in streams:
                busy |= self._advance(stream)
            if self.width.follow(time.monotonic()):
                self.counters[WIDTH], self.counters[WIDENED] = self.width.now, self.width.grown
            if not busy:
                with self._lock:  # a finished fetch wakes it: its slot is free again
                    self._lock.wait(_TICK)

    def _advance(self, s: _Stream) -> bool:
        """Move the window of one stream; True if it submitted work."""
        now = time.monotonic()
        low = s.low
        while low < s.next and self._taken(s, low):
            low += 1
        if low != s.low:
            s.low, s.progress_at, s.taken_at = low, now, now
        if s.low >= s.rows.size or now - s.progress_at > self.stale_seconds:
            self._drop(s, finished=s.low >= s.rows.size)
            return False
        submitted = False
        batch: list[tuple[int, int]] = []
        width = self.width.now
        held, held_bytes = self._outstanding(s)
        room = self._peer_room()
        while (s.next < s.rows.size and held < self.samples and held_bytes < self.nbytes
               and s.next - s.low < MAX_SPAN * self.samples and room > 0):
            if self._inflight >= width:
                # close behind: the readers are taking samples and less than half a
                # window is fetched ahead of them (before they read at all, no hurry)
                self.width.note_held(close=held < self.samples // 2
                                     and now - s.taken_at < _ADJUST_SECONDS)
                break
            pos = s.next
            s.next += 1
            if self._taken(s, pos):
                self.width.note_held(close=True)  # a reader got there first
                continue
            batch.append((int(s.ds[pos]), int(s.rows[pos])))
            held += 1
            room -= 1
            held_bytes += int(s.ends[pos + 1] - s.ends[pos])
            # Near the readers one sample per task (they are needed first, in parallel);
            # further ahead a few per task: a task per sample costs the control process
            # more CPU than a warm page-cache read costs the reader.
            if len(batch) >= (1 if held < 2 * width else _BATCH):
                self._submit(batch)
                batch, submitted = [], True
        if batch:
            self._submit(batch)
            submitted = True
        return submitted

    def _peer_room(self) -> int:
        """How many more samples the window may take on: where peers serve, each may
        pin a PeerShare slot until a reader takes it, so no more than the slots left
        (less the samples fetch threads have in hand); unbounded without peers. Every
        sample counts, wherever it comes from: a sample's source is the fetch thread's
        to find out, and local and store samples pin nothing, so they only make the
        bound cautious while the slots are full of unread peer extents."""
        if self.pool is None or self.pool.share is None:
            return 1 << 62
        return self._share.ahead_room() - self._samples_in_hand

    def _outstanding(self, s: _Stream) -> tuple[int, int]:
        """Samples (and their bytes) in [low, next) no reader has taken yet: what the
        window holds. Not the span from `low`: the processes of a DataLoader spread
        over the order (a worker that hits runs ahead of one that waits on the store;
        with batches, each worker is a batch apart), and a window counted from the
        slowest one left the fast ones past its end, reading the store themselves."""
        if s.next <= s.low:
            return 0, 0
        pending = ~self._taken_mask(s, s.low, s.next)
        sizes = np.diff(s.ends[s.low:s.next + 1])
        return int(pending.sum()), int(sizes[pending].sum())

    def _taken_mask(self, s: _Stream, lo: int, hi: int) -> np.ndarray:
        ds, first = s.ds[lo:hi], s.first[lo:hi]
        if s.single >= 0:
            return self._marks[s.single][first] != 0
        taken = np.zeros(hi - lo, bool)
        for k in np.unique(ds):
            mine = ds == k
            taken[mine] = self._marks[k][first[mine]] != 0
        return taken

    def _taken(self, s: _Stream, pos: int) -> bool:
        return bool(self._marks[s.ds[pos]][s.first[pos]])

    def _drop(self, s: _Stream, finished: bool) -> None:
        with self._lock:
            if self._streams.pop(s.key, None) is not None and not finished:
                self.counters[DROPPED_STALE] += 1
                log.info("look-ahead: dropped epoch %d of registration %d (nothing read for "
                         "%.0f s)", s.key[1], s.key[0], self.stale_seconds)

    def _submit(self, batch: list[tuple[int, int]]) -> None:
        with self._lock:
            self._inflight += 1
            self._samples_in_hand += len(batch)
        self._executor.submit(self._fetch_batch, batch)

    # -- the fetch threads -----------------------------------------------------------
    def _fetch_batch(self, batch: list[tuple[int, int]]) -> None:
        started = time.monotonic()
        try:
            if self.peer_pipeline and self.pool is not None and self.pool.share is not None:
                self._fetch_samples_together(batch)
            else:
                for ds, row in batch:
                    self._fetch_sample(ds, row)
        finally:
            spent = time.monotonic() - started
            with self._lock:
                self._inflight -= 1
                self._samples_in_hand -= len(batch)
                self.width.note_fetches(len(batch), spent)
                self._lock.notify_all()

    def _fetch_sample(self, ds: int, row: int) -> None:
        try:
            reader = self.ns.readers[ds]
            fetched = sum(self._fetch_extent(reader, ds, ext)
                          for ext in reader.directory.extents(row))
            with self._lock:
                self.counters[SAMPLES_AHEAD] += 1
                self.counters[BYTES_AHEAD] += fetched
        except Exception as err:  # the reader will meet (and report) the same problem
            self._count(FETCH_ERRORS)
            log.debug("look-ahead fetch of dataset %d row %d failed: %s", ds, row, err)

    def _fetch_samples_together(self, batch: list[tuple[int, int]]) -> None:
        """`_fetch_sample` for each sample of a batch, with the peer extents of all of
        them held back and fetched together at the end (`_from_peers`); an extent no
        peer served is read from the store then, as the per-extent way does."""
        fetched = [0] * len(batch)
        failed = [False] * len(batch)
        later: list[_PeerExtent] = []
        for k, (ds, row) in enumerate(batch):
            try:
                reader = self.ns.readers[ds]
                for ext in reader.directory.extents(row):
                    fetched[k] += self._fetch_extent(reader, ds, ext, later, k)
            except Exception as err:  # the reader will meet (and report) the same problem
                failed[k] = True
                log.debug("look-ahead fetch of dataset %d row %d failed: %s", ds, row, err)
        if later:
            try:
                self._from_peers(later, fetched)
            except Exception as err:
                for extent in later:
                    failed[extent.sample] = True
                log.debug("look-ahead peer fetch of %d extents failed: %s", len(later), err)
        with self._lock:
            for k in range(len(batch)):
                if failed[k]:
                    self.counters[FETCH_ERRORS] += 1
                else:
                    self.counters[SAMPLES_AHEAD] += 1
                    self.counters[BYTES_AHEAD] += fetched[k]

    def _from_peers(self, later: list[_PeerExtent], fetched: list[int]) -> None:
        """Fetch held-back peer extents (one alone the per-extent way) into PeerShare,
        adding what each brought to `fetched` of its sample; the store for those no
        peer served."""
        if len(later) == 1:
            results: list[int | None] = [self._prefetch(later[0])]
        else:
            reads = [(e.ds, e.chunk, int(e.reader.ext_offsets[e.ext]),
                      int(e.reader.ext_lengths[e.ext]), int(e.reader.ext_checksums[e.ext]))
                     for e in later]
            with self._lock:
                self.counters[PEER_FETCHES] += len(later)
                self.counters[PEER_BATCHES] += 1
            results = self._share.prefetch_many([extent_key(e.ds, e.ext) for e in later],
                                                self._pool.fetch_many, reads,
                                                lambda i, got: self._landed(later[i], got))
        for e, got in zip(later, results, strict=True):
            got = self._peer_fetched(e.ds, e.ext, e.chunk, got, marked=len(later) > 1)
            if got is None:
                offset = CHUNK_HEADER_SIZE + int(e.reader.ext_offsets[e.ext])
                got = self._from_store(e.reader, e.ds, e.ext, e.chunk, offset,
                                       int(e.reader.ext_lengths[e.ext]))
            fetched[e.sample] += got

    def _count(self, counter: int) -> None:
        with self._lock:
            self.counters[counter] += 1

    def _fetch_extent(self, reader: SampleReader, ds: int, ext: int,
                      later: list[_PeerExtent] | None = None, sample: int = 0) -> int:
        """Fetch one extent ahead where the readers' plan (dlfsd.core.extentsource) would
        read it: its length when it is fetched (or on its way), 0 when left to them.
        `later`: where an extent to fetch from a peer is put instead (for `sample` of
        the batch; 0 for now)."""
        state = self._states[ds]
        if state[ext] & AHEAD or self._marks[ds][ext]:
            return 0
        source = reader.source
        chunk = int(reader.ext_chunks[ext])
        offset = CHUNK_HEADER_SIZE + int(reader.ext_offsets[ext])
        length = int(reader.ext_lengths[ext])
        plan = source.plan(chunk, ahead=True)
        if plan & TRY_LOCAL and _will_need(source.local_fd(chunk), offset, length):
            # Not AHEAD (that sends the reader to the store copy): the bit that counts
            # the read as a hit and lets the pooled read serve it, as for a peer's
            # extent. Without it every read of a staged chunk was a miss.
            state[ext] |= PEER_AHEAD
            return length
        if plan & DEMAND:
            self._demand(source, chunk)
        if plan & TRY_PEER and not self.peer_ahead:
            self._count(SKIPPED_PEER)  # the readers fetch it from its owner
            return 0
        if plan & TRY_PEER and later is not None \
                and self._not_on_peers.get((ds, chunk), 0.0) <= time.monotonic():
            later.append(_PeerExtent(sample, reader, ds, ext, chunk))
            return 0
        if plan & TRY_PEER:
            fetched = self._from_peer(reader, ds, ext, chunk)
            if fetched is not None:
                return fetched
        return self._from_store(reader, ds, ext, chunk, offset, length)

    def _from_store(self, reader: SampleReader, ds: int, ext: int, chunk: int, offset: int,
                    length: int) -> int:
        """Read an extent ahead from the store and check it (STORE_OK | AHEAD: the reader
        takes it from the page cache, unpaced); one verified already and not throttled
        only gets WILLNEED. Its length, or 0 when the reader must read it itself."""
        state = self._states[ds]
        fd = reader.source.store_fd(chunk, ahead=True)
        if state[ext] & STORE_OK and not self.store_rate:
            _will_need(fd, offset, length)
            return length
        started = time.monotonic()
        data = os.pread(fd, length, offset)
        pace(self.store_rate, length, started)
        if len(data) != length or checksum(data) != reader.ext_checksums[ext]:
            self._count(FETCH_ERRORS)
            return 0  # the reader reads it itself, and reports it
        state[ext] |= STORE_OK | AHEAD
        return length

    def _from_peer(self, reader: SampleReader, ds: int, ext: int, chunk: int) -> int | None:
        """Fetch an extent from an owner peer into PeerShare ahead of the readers: its
        length (fetched now, or held already), 0 when another process fetches it or no
        slot was free (left to the readers), or None when no owner has it staged (then
        it is read ahead from the store)."""
        if self._not_on_peers.get((ds, chunk), 0.0) > time.monotonic():
            return None
        return self._peer_fetched(ds, ext, chunk,
                                  self._prefetch(_PeerExtent(0, reader, ds, ext, chunk)))

    def _prefetch(self, e: _PeerExtent) -> int | None:
        """One extent from its owners into PeerShare (PeerShare.prefetch)."""
        self._count(PEER_FETCHES)
        reader = e.reader
        return self._share.prefetch(
            extent_key(e.ds, e.ext), self._pool.fetch, e.ds, e.chunk,
            int(reader.ext_offsets[e.ext]), int(reader.ext_lengths[e.ext]),
            int(reader.ext_checksums[e.ext]))

    def _landed(self, e: _PeerExtent, fetched: int | None) -> None:
        """An extent of a pipelined batch is in its slot: mark it for the reader that
        takes it (a hit) now, not when the whole batch is in."""
        if fetched:
            self._states[e.ds][e.ext] |= PEER_AHEAD

    def _peer_fetched(self, ds: int, ext: int, chunk: int, fetched: int | None,
                      marked: bool = False) -> int | None:
        """Note what a prefetch of an extent brought (see _from_peer); returns it.
        `marked`: PEER_AHEAD was set as it landed (_landed)."""
        if fetched is None:  # its owner stages it now (a MISS asks it to): ask again later
            self._not_on_peers[(ds, chunk)] = time.monotonic() + NOT_ON_PEERS_SECONDS
            return None
        if fetched:
            if not marked:
                self._states[ds][ext] |= PEER_AHEAD
            with self._lock:
                self.counters[PEER_BYTES] += fetched
        else:
            self._count(SKIPPED_PEER)
        return fetched

    def _demand(self, source: ExtentSource, chunk: int) -> None:
        """Demand an owned chunk once per announcement (the readers demand it at every
        store read): staging then follows the announced order."""
        if (source.ds, chunk) not in self._demanded:
            self._demanded.add((source.ds, chunk))
            source.demand(chunk)
            self._count(DEMANDED)


@dataclass(slots=True)
class _PeerExtent:
    """An extent a fetch thread fetches from a peer with the others of its batch."""

    sample: int  # its sample's place in the batch
    reader: SampleReader
    ds: int
    ext: int
    chunk: int


class Width:
    """How many fetches the look-ahead runs at once, between `least` and `most`.

    Growing is asked for by the scheduler when its fetches, not its window, hold it
    back while the readers are close behind (less than half the window ahead, or a
    reader took a sample before the look-ahead got to it): then the readers read the
    store themselves, on their own streams, and the announcement buys little. It
    grows only while fetches wait on their source (SLOW_FETCH_SECONDS per sample):
    with the bytes in the page cache more threads would only take the readers' CPU. It
    grows by half at most every _ADJUST_SECONDS (a few steps from 8 to 32), and
    shrinks by one per period in which nothing held it back (the window was full):
    the streams a parallel file system serves are shared, and a look-ahead that
    keeps its lead needs no more. Written by the scheduler thread only.
    """

    def __init__(self, least: int, most: int) -> None:
        if not 1 <= least <= most:
            raise ValueError(f"look-ahead streams must be 1 <= MIN <= MAX, got {least}:{most}")
        self.least, self.most, self.now = least, most, least
        self.grown = self.shrunk = 0
        self._held = self._close = False
        self._samples, self._seconds = 0, 0.0
        self._since = time.monotonic()

    def note_fetches(self, samples: int, seconds: float) -> None:
        """`samples` fetched in `seconds` by one thread (called under the look-ahead's
        lock)."""
        self._samples += samples
        self._seconds += seconds

    def note_held(self, close: bool) -> None:
        """The fetches in flight (not the window) stopped the scheduler this pass."""
        self._held = True
        self._close |= close

    def follow(self, now: float) -> bool:
        """Once a period: grow, shrink or keep the width by what the period saw; True
        when the width changed."""
        if now - self._since < _ADJUST_SECONDS:
            return False
        was = self.now
        waited = self._seconds >= SLOW_FETCH_SECONDS * max(1, self._samples)
        if self._held and self._close and waited and self.now < self.most:
            self.now = min(self.most, self.now + max(1, self.now // 2))
            self.grown += 1
        elif not self._held and self.now > self.least:
            self.now -= 1
            self.shrunk += 1
        self._held = self._close = False
        self._samples, self._seconds = 0, 0.0
        self._since = now
        return self.now != was


def _will_need(fd: int, offset: int, length: int) -> bool:
    """Ask the page cache for a range of an open file (asynchronous; only a hint, so
    a failure is no error); False if there is no file (`fd` -1: not staged now)."""
    if fd < 0:
        return False
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    return True


def unknown_registration(handle) -> str:
    """The one line for an announcement of a registration the look-ahead does not hold."""
    return (f"unknown registration {handle!r} (the daemon was restarted, or more than "
            f"{MAX_REGISTRATIONS} samplers registered since, or the look-ahead's memory "
            "limit dropped it); register again")


def _extents_of(ext_start: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Every extent index of the files `rows` (ext_start[r] up to ext_start[r + 1])."""
    starts = ext_start[rows].astype(np.int64)
    counts = ext_start[rows + 1].astype(np.int64) - starts
    before = np.cumsum(counts) - counts  # extents of the rows ahead of each one
    return np.repeat(starts - before, counts) + np.arange(int(counts.sum()))


if TYPE_CHECKING:  # the seam ChunkPool fills for the look-ahead (mypy checks it, never run)
    def _feeds_lookahead(pool: ChunkPool) -> AheadPool:
        return pool

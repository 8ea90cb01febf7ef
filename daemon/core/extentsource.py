"""ExtentSource: where one dataset's extents come from, and the descriptors to read them.

Two parts of the daemon fetch extents: the reader (dlfsd.core.reader), for a FUSE
read, and the look-ahead (dlfsd.core.lookahead), before the readers ask. They used
to decide each on its own which copy to go to (this node's staged copy, an
owner peer, the store) and to keep descriptors each its own way; both now ask
this module (`plan`) and read through the descriptors it keeps (`store_fd`; a
staged copy's is ChunkCache.fd), so they cannot drift apart. What each does at
a source stays its own: the reader reads and checks the bytes it answers
with; the look-ahead asks the page cache for them (WILLNEED), fetches them
into the node's PeerShare, or reads and checks them ahead.

The plan for an extent of a chunk, tried in this order:

1. TRY_LOCAL: this node has a staged copy (ChunkCache).
2. TRY_PEER: another node owns the chunk (the pool asks its owners in
   placement order and skips peers marked down).
3. the store, always last. DEMAND: this node owns the chunk, so reaching the
   store asks the stager to stage it next (the reader each time, the
   look-ahead once per announcement).

The look-ahead's plan (`ahead=True`) leaves the peers out for a chunk this
node owns: it demands the chunk, so staging follows the announced order, and
reads the extent ahead from the store (docs/ORDER.md). Without a pool the
plan is 0: the store only.

The reader asks for a plan on every read of a pooled mount, so a plan is two
byte lookups: who owns a chunk never changes during a mount, so its bits are
worked out once per chunk (for readers and for the look-ahead), and only
whether it is staged is read at the time (ChunkCache's shared map). Store
descriptors are kept per process in a list, taken without a lock once open
(opening, the rare case, takes one: the look-ahead's threads share them).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import resource
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dlfs.errors import CorruptDataError, FormatError
from dlfs.store.format import CHUNK_HEADER_SIZE, check_chunk_header
from dlfs.store.store import Dataset
from dlfsd.pool.chunkcache import ChunkCache

if TYPE_CHECKING:
    from dlfsd.pool.peershare import PeerShare
    from dlfsd.pool.pool import ChunkPool

log = logging.getLogger(__name__)

# Bits of a plan (ExtentSource.plan); the store is always the last source.
TRY_LOCAL = 1  # this node's staged copy
TRY_PEER = 2  # an owner peer
DEMAND = 4  # this node owns the chunk: a read that reaches the store demands it


class DemandSink(Protocol):
    """Where any process asks the stager to stage a chunk next (DemandChannel)."""

    def send(self, ds: int, chunk: int) -> None: ...


class SourcePool(Protocol):
    """What ExtentSource needs of the chunk pool (ChunkPool), per dataset index: the
    staged copies, whether this node owns each chunk, the other owners, and where to
    demand a chunk."""

    @property
    def caches(self) -> Sequence[ChunkCache]: ...

    @property
    def owned(self) -> Sequence[np.ndarray]: ...

    @property
    def remote_owners(self) -> Sequence[Sequence[tuple[int, ...]]]: ...

    @property
    def demand(self) -> DemandSink: ...


class ReaderPool(SourcePool, Protocol):
    """What SampleReader needs of the chunk pool (ChunkPool) besides the sources: the
    node's shared peer fetches (None: a pool of one node, no peers), a fetch of an
    extent's bytes from an owner peer, and dropping a staged copy found bad."""

    @property
    def share(self) -> PeerShare | None: ...

    def fetch(self, ds: int, chunk: int, offset: int, length: int,
              expected: int) -> bytes | memoryview | None: ...

    def evict_copy(self, ds: int, chunk: int, fd: int) -> bool: ...


class _NoDemand:
    """Without a pool: no plan has DEMAND, so nothing is ever sent here."""

    def send(self, ds: int, chunk: int) -> None:
        pass


class _NoCopies:
    """Without a pool: no plan has TRY_LOCAL, and no chunk has a staged copy."""

    def fd(self, chunk: int) -> int:
        return -1


class ExtentSource:
    """The sources of one dataset's extents in this process: the plan, the descriptors.

    `pool` (cluster mode) gives the staged copies, who owns each chunk and the demand
    channel; `ds` is the dataset's index in it.
    """

    def __init__(self, dataset: Dataset, pool: SourcePool | None = None, ds: int = 0) -> None:
        self.dataset = dataset
        self.ds = ds
        self._store_fds: list[int] = [-1] * dataset.chunk_count
        self._open_lock = threading.Lock()  # opening only; a kept descriptor needs none
        self._unusable: set[int] = set()  # store chunk files that failed to open: logged
        self._purges = 0  # times a reader ran out of descriptors (see _open_or_purge)
        self._demand: DemandSink = _NoDemand() if pool is None else pool.demand
        self._copies: ChunkCache | _NoCopies = _NoCopies()  # this node's staged copies
        # Per chunk: staged (non-zero) or not; the plan bits besides TRY_LOCAL, for a
        # reader and for the look-ahead. Without a pool: nothing, the store only.
        self._staged: bytes | mmap.mmap = bytes(dataset.chunk_count)
        self._read_plans = self._ahead_plans = self._staged
        if pool is not None:
            cache = self._copies = pool.caches[ds]
            self._staged = cache.state_map
            self._read_plans, self._ahead_plans = _plans(pool.owned[ds],
                                                         pool.remote_owners[ds])

    # -- where from ------------------------------------------------------------------
    def plan(self, chunk: int, ahead: bool = False) -> int:
        """The sources to try for an extent of `chunk` before the store: TRY_LOCAL,
        TRY_PEER and DEMAND bits (see the module docstring). `ahead`: the look-ahead's
        plan, which tries no peer for a chunk this node owns."""
        plan = (self._ahead_plans if ahead else self._read_plans)[chunk]
        return plan | TRY_LOCAL if self._staged[chunk] else plan

    def demand(self, chunk: int) -> None:
        """Ask the stager to stage `chunk` next (a plan with DEMAND reached the store)."""
        self._demand.send(self.ds, chunk)

    def local_fd(self, chunk: int) -> int:
        """The descriptor of this node's staged copy of `chunk` (ChunkCache.fd), -1 if
        there is none (OSError: it cannot be opened)."""
        return self._copies.fd(chunk)

    # -- the store's chunk files -----------------------------------------------------
    def store_fd(self, chunk: int, ahead: bool = False) -> int:
        """This process's descriptor of the store's chunk file: opened and its header
        checked on first use, then kept.

        For a reader (a worker serves one request at a time), a file that cannot be
        used is logged once per chunk and raised as CorruptDataError (the read is EIO),
        and out of descriptors it closes the ones kept and tries again. `ahead` (the
        look-ahead's threads): neither; another thread may be reading through a kept
        descriptor, and the reader reports a bad file when it meets it. OSError or
        FormatError then come out as they are.
        """
        fd = self._store_fds[chunk]
        if fd >= 0:
            return fd
        return self._open_store(chunk, ahead)

    def _open_store(self, chunk: int, ahead: bool) -> int:
        with self._open_lock:
            fd = self._store_fds[chunk]
            if fd < 0:
                path = self.dataset.chunk_path(chunk)
                if ahead:
                    fd = open_chunk(path, chunk, self.dataset.uuid)
                else:
                    fd = self._open_for_reader(path, chunk)
                self._store_fds[chunk] = fd
            return fd

    def _open_for_reader(self, path, chunk: int) -> int:
        try:
            return self._open_or_purge(path, chunk)
        except (OSError, FormatError) as err:
            if chunk not in self._unusable:
                self._unusable.add(chunk)
                log.error("cannot use chunk %d of dataset %s: %s; reads return EIO",
                          chunk, self.dataset.name, err)
            raise CorruptDataError(str(err)) from None

    def _open_or_purge(self, path, chunk: int) -> int:
        """Open a chunk file; out of descriptors, a worker process closes the ones it
        keeps open and tries again (a dataset with more chunk files than the open-file
        limit). A worker serves one request at a time, so none of them is in use."""
        try:
            return open_chunk(path, chunk, self.dataset.uuid)
        except OSError as err:
            if err.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        if not self._purges:
            log.warning("worker %d: out of file descriptors (open-file limit %d) with %d "
                        "chunk files of dataset %s open; closing them, and again whenever "
                        "it runs out (raise the limit: see the mount log's first lines)",
                        os.getpid(), resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                        sum(fd >= 0 for fd in self._store_fds), self.dataset.name)
        self._purges += 1
        self._close_store_fds()
        return open_chunk(path, chunk, self.dataset.uuid)

    def close_store_fds(self) -> None:
        """Close the store descriptors kept (they are opened again when needed): the
        look-ahead's when it stops, all of them when the reader closes."""
        with self._open_lock:
            self._close_store_fds()

    def _close_store_fds(self) -> None:
        for i, fd in enumerate(self._store_fds):
            if fd >= 0:
                os.close(fd)
                self._store_fds[i] = -1


def _plans(owned: np.ndarray, remote: Sequence[tuple[int, ...]]) -> tuple[bytes, bytes]:
    """The plan bits of each chunk besides TRY_LOCAL, for a reader and for the look-ahead:
    DEMAND where this node owns the chunk, TRY_PEER where another node does (the
    look-ahead: only where this node does not)."""
    on_peers = np.fromiter((bool(r) for r in remote), bool, len(remote))
    demand = np.where(owned, DEMAND, 0)
    read = demand | np.where(on_peers, TRY_PEER, 0)
    ahead = demand | np.where(on_peers & ~owned, TRY_PEER, 0)
    return read.astype(np.uint8).tobytes(), ahead.astype(np.uint8).tobytes()


def open_chunk(path, index: int, dataset_uuid: bytes) -> int:
    """Open a chunk file and check its header once (magic, version, owner)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        check_chunk_header(os.pread(fd, CHUNK_HEADER_SIZE, 0), path, index, dataset_uuid)
    except BaseException:
        os.close(fd)
        raise
    return fd


if TYPE_CHECKING:  # the seams ChunkPool fills for the core (mypy checks them, never run)
    def _sources_extents(pool: ChunkPool) -> SourcePool:
        return pool

    def _feeds_readers(pool: ChunkPool) -> ReaderPool:
        return pool

"""ReplicaSource: a chunk's secondary owners copy it from its primary, not the store.

With `--replicas R` every owner of a chunk stages a copy. Copied from the
store, the store would serve each chunk R times per job; the store is the one
resource a job's nodes share, so the first owner in placement order (the
primary) copies from the store and the other owners (the secondaries) copy
from the primary over the pool, in reads of up to one protocol frame
(protocol.MAX_READ). The stager verifies the written copy as it does a store
copy (header, every extent checksum), so a bad primary copy is never published.

A secondary never waits for its primary without bound:

* MISS (the primary has not staged the chunk yet; the request itself moves it
  to the front of the primary's queue): the chunk waits (the stager tries it
  again after POLL_SECONDS and goes on with others). It goes to the store once
  it has waited `wait` seconds with no chunk arriving from that primary
  meanwhile (a primary that is slow, or over its --cache-limit): counted
  `fallback_slow`.
* The primary cannot be reached: right after the mount started (within
  `wait`, and before it ever answered) it is taken for a daemon not up yet,
  and the chunk waits as for a MISS; otherwise the primary is skipped for
  DOWN_SECONDS and the chunk (and every chunk of that primary meanwhile) is
  copied from the store: `fallback_down`.
* FAIL `not-staging` (the primary will not stage it: over its --cache-limit, or
  its cache disk cannot be written): the store, at once (`fallback_declined`).
* Its bytes fail the written copy's check, or it refuses the range: the chunk
  comes from the store (`fallback_bad`).

The stager's jobs call this from their copy threads: each thread takes a
client of its own (a BlockingPeerClient with its own receive buffer) from a
small per-peer pool.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from dlfs.cluster.nodes import ClusterView
from dlfs.store.format import CHUNK_HEADER_SIZE, pack_chunk_header
from dlfs.store.store import Dataset
from dlfsd.pool import protocol
from dlfsd.pool.peer import PeerMiss, PeerUnavailable
from dlfsd.pool.peersync import BlockingPeerClient

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # a chunk the primary has not staged yet is asked for again after this
DOWN_SECONDS = 10.0  # an unreachable primary's chunks come from the store for this long
WAITING_WINDOW = 16  # chunks waiting for their primaries at once (the rest wait their turn)
DEFAULT_WAIT = 30.0  # seconds without progress from a primary before its chunks go to the store


class PrimaryNotReady(Exception):
    """The primary has no copy yet (or its daemon is not up yet): try again later."""


class ReplicaSource:
    """Which owner a chunk is copied from, and the copy itself (blocking)."""

    def __init__(self, view: ClusterView, datasets: list[Dataset], tables: list,
                 peer_timeout: float = 5.0, wait: float = DEFAULT_WAIT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`tables`: per dataset the (chunks, R) owner table of dlfs.cluster.placement,
        best owner first. `wait` 0 copies every chunk from the store (the old way)."""
        self.view = view
        self.datasets = datasets
        self.peer_timeout = peer_timeout
        self.wait = wait
        self._clock = clock
        me = view.self_index
        # Per dataset and chunk: the primary's node index, or -1 (we are the primary,
        # or we do not own the chunk).
        self.primaries = [_primaries(t, me) for t in tables]
        self.started = clock()
        self._lock = threading.Lock()
        self._idle: dict[int, list[BlockingPeerClient]] = {}
        self._down_until: dict[int, float] = {}
        self._answered: set[int] = set()  # primaries that answered at least once
        self._logged: set[tuple[int, str]] = set()  # (primary, kind of fallback) logged
        self._last_copy: dict[int, float] = {}  # primary -> when a chunk last came from it
        self._waiting: dict[tuple[int, int], float] = {}  # (ds, chunk) -> waiting since
        self.counters = {"from_store_chunks": 0, "from_store_bytes": 0,
                         "from_peer_chunks": 0, "from_peer_bytes": 0, "waits": 0,
                         "fallback_down": 0, "fallback_slow": 0, "fallback_declined": 0,
                         "fallback_bad": 0}

    # -- deciding (the stager's trio thread) -----------------------------------------
    def is_secondary(self, ds: int, chunk: int) -> bool:
        return self.wait > 0 and self.primaries[ds][chunk] >= 0

    def source(self, ds: int, chunk: int) -> int | None:
        """The node to copy the chunk from now, or None for the store (counted)."""
        if not self.is_secondary(ds, chunk):
            return None
        node = int(self.primaries[ds][chunk])
        now = self._clock()
        if self._down_until.get(node, 0.0) > now:
            self._fall_back(ds, chunk, "fallback_down")
            return None
        since = self._waiting.get((ds, chunk))
        if since is not None and now - max(since, self._last_copy.get(node, 0.0)) > self.wait:
            self._log_once(node, "slow", logging.WARNING, "primary %s has sent nothing for "
                           "%.0f s (chunk %d of %s waits for it); copying such chunks from "
                           "the store", self.view.nodes[node].name, self.wait, chunk,
                           self.datasets[ds].name)
            self._fall_back(ds, chunk, "fallback_slow")
            return None
        return node

    def waiting_count(self) -> int:
        return len(self._waiting)

    def is_waiting(self, ds: int, chunk: int) -> bool:
        return (ds, chunk) in self._waiting

    def forget(self, ds: int, chunk: int) -> None:
        """The chunk is not waiting any more (staged, or passed over)."""
        self._waiting.pop((ds, chunk), None)

    def _fall_back(self, ds: int, chunk: int, why: str) -> None:
        self._waiting.pop((ds, chunk), None)
        self._count(why)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:  # the trio thread and the copy threads count
            self.counters[name] += n

    def count_store_copy(self, nbytes: int) -> None:
        self._count("from_store_chunks")
        self._count("from_store_bytes", nbytes)

    def snapshot(self) -> dict[str, int]:
        """The counters, for `dlfs status` (plus how many chunks wait right now)."""
        with self._lock:
            return {**self.counters, "waiting": len(self._waiting)}

    # -- copying (a stager copy thread) -----------------------------------------------
    def copy(self, node: int, ds: int, chunk: int, fd: int, stopping: Callable[[], bool]) -> bool:
        """Write the chunk (header and data) from `node` into `fd`; False if unmounting cut
        it short. Raises PrimaryNotReady (try later) or PeerUnavailable (the store, now)."""
        dataset = self.datasets[ds]
        length = int(dataset.chunk_lengths[chunk])
        os.pwrite(fd, pack_chunk_header(chunk, length, dataset.uuid), 0)
        client = self._take(node)
        try:
            pos = 0
            while pos < length:
                if stopping():
                    return False
                want = min(protocol.MAX_READ, length - pos)
                try:
                    data = client.read(dataset.uuid, chunk, pos, want)
                except PeerMiss as miss:
                    if pos or miss.code:  # evicted under us, or it cannot read its copy
                        raise
                    self._not_ready(node, ds, chunk)
                    raise PrimaryNotReady(str(miss)) from None
                except PeerUnavailable:
                    if self._starting(node):
                        self._not_ready(node, ds, chunk)
                        raise PrimaryNotReady(f"peer {self.view.nodes[node].name} is not "
                                              "up yet") from None
                    raise
                self._answered.add(node)
                _write_all(fd, data, CHUNK_HEADER_SIZE + pos)
                pos += want
        finally:
            self._give_back(node, client)
        return True

    def copied(self, node: int, ds: int, chunk: int) -> None:
        """The copy from `node` was verified and published."""
        self._waiting.pop((ds, chunk), None)
        self._last_copy[node] = self._clock()
        self._count("from_peer_chunks")
        self._count("from_peer_bytes", int(self.datasets[ds].chunk_lengths[chunk]))

    def failed(self, node: int, ds: int, chunk: int, err: Exception) -> None:
        """The copy from `node` failed (unreachable, refused, bad bytes): the store next."""
        if isinstance(err, PeerUnavailable):
            if self._down_until.get(node, 0.0) <= self._clock():
                log.warning("primary %s cannot be reached (%s); copying its chunks from the "
                            "store for %.0f s", self.view.nodes[node].name, err, DOWN_SECONDS)
            self._down_until[node] = self._clock() + DOWN_SECONDS
            self._fall_back(ds, chunk, "fallback_down")
        elif isinstance(err, PeerMiss) and err.code == protocol.FAIL_NOT_STAGING:
            self._log_once(node, "declined", logging.INFO, "primary %s will not stage chunk %d "
                           "of %s (over its --cache-limit, or its cache disk is full); "
                           "copying such chunks from the store", self.view.nodes[node].name,
                           chunk, self.datasets[ds].name)
            self._fall_back(ds, chunk, "fallback_declined")
        else:
            self._log_once(node, "bad", logging.WARNING, "chunk %d of %s: the copy from "
                           "primary %s failed (%s); copying it from the store (further such "
                           "failures of this primary are logged at DEBUG)", chunk,
                           self.datasets[ds].name, self.view.nodes[node].name, err)
            self._fall_back(ds, chunk, "fallback_bad")

    def _log_once(self, node: int, kind: str, level: int, msg: str, *args) -> None:
        """The first fallback of a kind per primary at `level`, the rest at DEBUG: a
        primary that cannot help fails each of its chunks the same way."""
        first = (node, kind) not in self._logged
        self._logged.add((node, kind))
        log.log(level if first else logging.DEBUG, msg, *args)

    def _not_ready(self, node: int, ds: int, chunk: int) -> None:
        if (ds, chunk) not in self._waiting:
            self._waiting[(ds, chunk)] = self._clock()
        self._count("waits")

    def _starting(self, node: int) -> bool:
        """An unreachable primary that never answered, early in the mount: its daemon
        may just not be listening yet (the job's daemons start one by one)."""
        return node not in self._answered and self._clock() - self.started < self.wait

    def _take(self, node: int) -> BlockingPeerClient:
        with self._lock:
            idle = self._idle.get(node)
            if idle:
                return idle.pop()
        peer = self.view.nodes[node]
        return BlockingPeerClient(self.view.secret, self.view.me.name, peer.host, peer.port,
                                  timeout=self.peer_timeout, own_buffer=True,
                                  alt_ports=peer.alt_ports)

    def _give_back(self, node: int, client: BlockingPeerClient) -> None:
        with self._lock:
            self._idle.setdefault(node, []).append(client)

    def close(self) -> None:
        with self._lock:
            for clients in self._idle.values():
                for client in clients:
                    client.close()
            self._idle.clear()


def _primaries(table, me: int):
    """Per chunk the primary's node index where `me` is a secondary owner, else -1."""
    secondary = (table[:, 1:] == me).any(axis=1) if table.shape[1] > 1 else \
        np.zeros(len(table), dtype=bool)
    return np.where(secondary & (table[:, 0] != me), table[:, 0], -1).astype(np.int64)


def _write_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n

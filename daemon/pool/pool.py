"""ChunkPool: the job's chunks as one daemon sees them.

Placement says which nodes own each chunk; this node's ChunkCaches hold the
copies it staged; BlockingPeerClients reach the other owners. The reader asks the
pool for a remote extent, and the pool tries the owners in placement order,
skipping peers marked down, checking every byte against the manifest
checksum; a peer that times out or refuses is skipped for DOWN_SECONDS, by
every process of the node (PeerMarks.node_down: a partitioned peer costs a
reader one --peer-timeout, not one per worker process); after that one read
of one process tries it again while the others still skip it. A peer whose
reads are slow is asked last, after the chunk's other live owners, for
SLOW_SECONDS, by every process of the node; it still serves where it is the
only owner left (the store is not known to be faster). Two rules find it
(dlfsd.pool.slowpeers): a share of slow reads (a 10 Mbit/s link: most reads
slow), and the time its reads cost against the other peers' (a link losing
single packets: a few reads in a hundred wait a ~210 ms retransmission, the
rest are fast). `dlfs status` names the peer and why.
A peer whose bytes of a chunk fail their checksum has a bad copy of that
chunk (a flipped bit on its NVMe; the protocol itself is authenticated and
length-checked): only that chunk is read elsewhere while the peer keeps
serving its other chunks, and the reader reports the range to the peer (a
REPORT, rate limited), which re-checks that extent of its copy and, if bad,
evicts and re-stages it at once. A reported copy is avoided for
REPORTED_BAD_SECONDS, doubling while it stays bad, up to BAD_COPY_SECONDS
(what an unreported one gets: a version 1 peer, or reports over their rate).
Whole extents fetched from peers, and the fetches under way, are shared by
all the daemon's processes (PeerShare): a node asks a peer once per extent,
however many workers read parts of it.

The pool is also the peer server's ChunkProvider: it serves byte ranges of
staged chunks, a request for an owned chunk not staged yet moves that chunk
to the front of the staging queue, a copy the server cannot read is evicted
and staged again, and it checks copies: a reported range, an extent before
it is first served (--verify-served), a copy the scrub reads.

Peer clients are blocking (dlfsd.pool.peersync: the worker processes serve
one request at a time); forked workers call `after_fork` and open their own.
Another thread of a process (the look-ahead's fetch threads) gets clients of
its own, with buffers of their own, so its fetches go in parallel with the
other threads' rather than one at a time; `fetch_many` sends a thread's extents
for one owner together, pipelined on its connection (BlockingPeerClient.read_many).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dlfs.cluster.nodes import ClusterView
from dlfs.cluster.placement import owners
from dlfs.store.format import CHUNK_HEADER_SIZE, checksum
from dlfs.store.nodecache import is_dataset_dir
from dlfs.store.store import Dataset
from dlfsd.base.throttle import TokenBucket
from dlfsd.obs.peermarks import NO_PEER_MARKS, NullPeerMarks, PeerMarks
from dlfsd.obs.stalls import NO_REQUESTS, WAIT_PEER, NullRequests, RequestSlots
from dlfsd.pool.chunkcache import ChunkCache
from dlfsd.pool.peer import PeerError, PeerMiss, PeerUnavailable, PeerUnreachable
from dlfsd.pool.peershare import SHARE_BYTES, PeerShare
from dlfsd.pool.peersync import BlockingPeerClient
from dlfsd.pool.protocol import BadRange
from dlfsd.pool.slowpeers import SlowPeers
from dlfsd.pool.stager import DemandChannel

if TYPE_CHECKING:
    from dlfsd.pool.peerserver import BlockingChunkProvider

log = logging.getLogger(__name__)

DOWN_SECONDS = 10.0
# A peer that refuses connections and never answered this process, within STARTUP_SECONDS
# of the mount's start, is most likely a daemon of the job not up yet (they start one by
# one, and a job step may read at once): asked again after STARTING_DOWN_SECONDS, not 10 s.
STARTUP_SECONDS = 30.0
STARTING_DOWN_SECONDS = 0.5
BAD_COPY_SECONDS = 60.0
REPORTED_BAD_SECONDS = 2.0  # the peer re-stages a reported copy at once: look again soon
REPORTS_PER_SECOND, REPORT_BURST = 2.0, 5  # per process: a rotting disk costs peers little
SLOW_SECONDS = 30.0  # a peer found slow (dlfsd.pool.slowpeers) is asked last this long
_NO_MARK = (0.0, 0)

# One extent for fetch_many: (ds, chunk, offset, length, expected checksum), as fetch takes it.
PeerRead = tuple[int, int, int, int, int]
# fetch_many's callback: (index of the read, its checked bytes or None), once per read.
OnFetched = Callable[[int, "bytes | memoryview | None"], None]

# Whether the stager will stage chunk (ds, chunk) soon (Stager.will_stage; set_stager).
WillStage = Callable[[int, int], bool]


class ChunkPool:
    """Placement, local caches and peer clients for the mounted datasets."""

    def __init__(self, view: ClusterView, datasets: list[Dataset], cache_root: Path,
                 peer_timeout: float = 5.0, processes: int = 1,
                 ahead: tuple[int, int] = (0, 0)) -> None:
        """`processes`: how many of the daemon's processes may read from peers (main,
        workers, the control process), for the shared fetch counters' rows.
        `ahead`: the look-ahead's window (samples, bytes; dlfsd.core.lookahead), for which
        PeerShare makes room besides the readers' own shared fetches: what it fetches
        from peers ahead then stays until it is read (a sample per slot of the largest
        extent, at most the window's bytes)."""
        self.view = view
        self.datasets = datasets
        self.peer_timeout = peer_timeout
        self.caches = [ChunkCache(cache_root, d) for d in datasets]
        me = view.self_index
        self.tables = [owners(d.uuid, d.chunk_count, view.names, view.replicas)
                       for d in datasets]
        self.owned = [(t == me).any(axis=1) for t in self.tables]
        # Per chunk: the other owners, best first (tuples: looked up on every remote read).
        self.remote_owners = [[tuple(int(n) for n in row if n != me) for row in t]
                              for t in self.tables]
        self.demand = DemandChannel()
        self._will_stage: WillStage = lambda ds, chunk: bool(self.owned[ds][chunk])  # set_stager
        self._by_id = {d.uuid: i for i, d in enumerate(datasets)}
        self._clients: dict[int, BlockingPeerClient] = {}  # the process's main thread's
        self._owner = threading.get_ident()  # that thread (see _client)
        self._threads = threading.local()  # other threads' clients
        self._thread_clients: list[BlockingPeerClient] = []  # all of those, to close
        self._down_until: dict[int, float] = {}
        # Skipped until, per node, for every process (PeerMarks.node_down once report_to
        # gave one; this process's own until then).
        self._node_down = np.zeros(len(view.nodes), np.float64)
        self._node_slow = np.zeros(len(view.nodes), np.float64)  # asked last until
        self._slow_peers = SlowPeers([node.name for node in view.nodes])  # this process's reads
        self.started = time.monotonic()  # the mount's start (see STARTUP_SECONDS)
        self._answered: set[int] = set()  # peers that answered a read of this process
        self._starting_logged: set[int] = set()
        # (node, ds, chunk) -> (avoid until, times found bad in a row)
        self._bad_copies: dict[tuple[int, int, int], tuple[float, int]] = {}
        self._reports = TokenBucket(REPORTS_PER_SECOND, REPORT_BURST)
        # --verify-served: per extent, the copy generation it was checked in (serve_check);
        # shared by the peer server's processes (pages are only used where written)
        self._checked = [_shared_bytes(d.directory.extent_count) for d in datasets]
        self._chunk_extents: list[list[int] | None] = [None] * len(datasets)  # extents_in
        # Shared by the forked workers, so made now; only where there are peers to read.
        self.share: PeerShare | None = None
        if len(view.nodes) > 1 and datasets:
            # A waiter gives a fetch as long as the fetch may take: each other owner in
            # turn, up to its timeout, plus a second.
            wait = peer_timeout * max(1, view.replicas - 1) + 1.0
            slot = max(d.directory.extent_size for d in datasets)
            samples, nbytes = ahead
            self.share = PeerShare(slot, wait, processes,
                                   budget=SHARE_BYTES + min(nbytes, samples * slot))
        # Where the marks above and the peer a read waits for are seen by the main
        # process (dlfs status, .dlfs/metrics); set by report_to before the fork.
        self.requests: RequestSlots | NullRequests = NO_REQUESTS
        self.marks: PeerMarks | NullPeerMarks = NO_PEER_MARKS

    def report_to(self, requests: RequestSlots | NullRequests,
                  marks: PeerMarks | NullPeerMarks) -> None:
        """Note the peer each read tries in `requests` (the stall detector) and every
        peer mark in `marks` (shared memory: each process's marks are its own)."""
        self.requests, self.marks = requests, marks
        down, slow = marks.node_down, marks.node_slow  # (both or neither: NullPeerMarks)
        if down is not None and slow is not None:
            self._node_down, self._node_slow = down, slow

    def scan_caches(self, limit: int = 0) -> int:
        """Adopt chunks staged by an earlier mount; returns how many are kept.

        Over `limit` bytes (0: no limit; a remount with a lower --cache-limit), copies
        are dropped until it fits: first those this node does not own (its share
        changes with the node list), then its own, from the last chunk back.
        """
        adopted = sum(cache.scan() for cache in self.caches)
        used = sum(cache.staged_bytes() for cache in self.caches)
        for own in (False, True):
            for ds, cache in enumerate(self.caches):
                for chunk in range(cache.dataset.chunk_count - 1, -1, -1):
                    if not limit or used <= limit:
                        break
                    if cache.is_staged(chunk) and bool(self.owned[ds][chunk]) == own:
                        used -= int(cache.lengths[chunk])
                        cache.evict(chunk)
                        adopted -= 1
        for cache in self.caches:
            cache.adopted_at_mount = int(cache.adopted_mask().sum())
        return adopted

    def foreign_copies(self) -> tuple[int, int]:
        """(directories, bytes) of staged copies in the cache dir that belong to no
        dataset of this mount: earlier versions of re-populated or removed datasets,
        or another mount's. Never counted against --cache-limit, never removed here
        (a cache dir may be shared): the admin is told at mount."""
        ours = {cache.dir.name for cache in self.caches}
        root = self.caches[0].dir.parent if self.caches else None
        dirs = nbytes = 0
        try:
            entries = list(os.scandir(root)) if root is not None else []
        except OSError:
            return 0, 0
        for entry in entries:
            if entry.name in ours or not is_dataset_dir(entry):
                continue
            dirs += 1
            with contextlib.suppress(OSError), os.scandir(entry.path) as files:
                nbytes += sum(f.stat(follow_symlinks=False).st_size for f in files
                              if f.is_file(follow_symlinks=False))
        return dirs, nbytes

    def after_fork(self) -> None:
        """In a forked worker: drop the parent's client objects and peer health."""
        self._clients = {}
        self._slow_peers.forget()
        self._owner = threading.get_ident()
        self._threads = threading.local()
        self._thread_clients = []
        self._down_until = {}
        self._bad_copies = {}

    def close(self) -> None:
        for client in [*self._clients.values(), *self._thread_clients]:
            client.close()
        for cache in self.caches:
            cache.close()
        for checked in self._checked:
            checked.close()
        if self.share is not None:
            self.share.close()
        self.demand.close()

    # -- reads from peers ------------------------------------------------------------
    def fetch(self, ds: int, chunk: int, offset: int, length: int,
              expected: int) -> bytes | memoryview | None:
        """Bytes [offset, offset+length) of a chunk from an owner peer, checked against
        `expected` (the extent's checksum); None when no peer could serve them. Blocking
        (a worker process serves one request at a time). The bytes may be a view of the
        client's buffer: valid until the next fetch."""
        dataset_id = self.datasets[ds].uuid
        for node in self._live_owners(ds, chunk):
            self.requests.waiting(WAIT_PEER, node)
            started = time.monotonic()
            try:
                data = self._client(node).read(dataset_id, chunk, offset, length)
            except PeerError as err:
                self._peer_failed(node, err)
                continue
            self._timed(node, time.monotonic() - started, length)
            if self._accept(node, ds, chunk, data, length, expected):
                return data
            if len(data) == length:  # a bad copy there: tell it
                bad = BadRange(dataset_id, chunk, offset, length)
                reported = self._reports.take() and self._client(node).report(bad)
                self._bad_copy(node, ds, chunk, reported)
        return None

    def fetch_many(self, reads: Sequence[PeerRead], on_fetched: OnFetched) -> None:
        """`fetch` for several extents: `on_fetched(i, data)` once per read, with its
        checked bytes (a view valid during the call only) or None when no peer could
        serve them. The reads that would go to the same owner go together, pipelined on
        one connection (BlockingPeerClient.read_many); each read goes through its
        owners in `fetch`'s order with `fetch`'s checks, marks and timing (a reply is
        timed from the one before it: its own cost on the wire, not its wait in
        line), and what an owner did not serve tries the read's next owner, batched
        again with the others that go there."""
        owners = [self._live_owners(ds, chunk) for ds, chunk, _, _, _ in reads]
        todo = list(range(len(reads)))
        while todo:
            by_node: dict[int, list[int]] = {}
            for index in todo:
                node = next(owners[index], -1)
                if node < 0:
                    on_fetched(index, None)
                else:
                    by_node.setdefault(node, []).append(index)
            todo = []
            for node, batch in by_node.items():
                todo += self._fetch_from(node, [reads[i] for i in batch], batch, on_fetched)

    def _fetch_from(self, node: int, reads: list[PeerRead], indices: list[int],
                    on_fetched: OnFetched) -> list[int]:
        """One owner's part of fetch_many; returns the indices it did not serve."""
        datasets = self.datasets
        client = self._client(node)
        unserved: list[int] = []
        answered = [False] * len(reads)
        clock = [time.monotonic()]

        def on_reply(k: int, data: bytes | memoryview | PeerError) -> None:
            answered[k] = True
            ds, chunk, offset, length, expected = reads[k]
            if isinstance(data, PeerError):
                self._peer_failed(node, data)
                unserved.append(indices[k])
                clock[0] = time.monotonic()
                return
            self._timed(node, time.monotonic() - clock[0], length)
            if self._bad_copies and self._bad_copies.get(
                    (node, ds, chunk), _NO_MARK)[0] > time.monotonic():
                # An extent of this chunk came bad earlier in the batch: as `fetch` would
                # have, read the chunk elsewhere (and keep the mark: its copy is bad).
                unserved.append(indices[k])
            elif self._accept(node, ds, chunk, data, length, expected):
                on_fetched(indices[k], data)
            else:
                if len(data) == length:  # a bad copy there: tell it
                    bad = BadRange(datasets[ds].uuid, chunk, offset, length)
                    reported = self._reports.take() and client.report(bad)
                    self._bad_copy(node, ds, chunk, reported)
                unserved.append(indices[k])
            clock[0] = time.monotonic()

        self.requests.waiting(WAIT_PEER, node)
        try:
            client.read_many([(datasets[ds].uuid, chunk, offset, length)
                              for ds, chunk, offset, length, _ in reads], on_reply)
        except PeerError as err:  # the connection: the reads it did not answer go on
            self._peer_failed(node, err)
            unserved += [i for i, done in zip(indices, answered, strict=True) if not done]
        return unserved

    def _live_owners(self, ds: int, chunk: int) -> Iterator[int]:
        """The other owners of a chunk in placement order, skipping peers marked down
        (by any process of the node); slow ones last."""
        now = time.monotonic()
        bad = self._bad_copies
        down = self._node_down
        owners: Sequence[int] = self.remote_owners[ds][chunk]
        if len(owners) > 1:
            slow = self._node_slow
            if any(slow[n] > now for n in owners):
                owners = sorted(owners, key=lambda n: slow[n] > now)
        return (n for n in owners if self._up(n, down, now)
                and (not bad or bad.get((n, ds, chunk), _NO_MARK)[0] <= now))

    def _up(self, node: int, down: np.ndarray, now: float) -> bool:
        """Not skipped now. A node-wide mark that has just run out is taken by the
        first process that looks: it tries the peer, and the others keep skipping it
        for as long as that read may take (one pays for a peer still cut off)."""
        until = down[node]
        if until > now:
            return False
        if until:
            down[node] = now + self.peer_timeout + 1.0  # we try it; the others wait
        return True

    def _timed(self, node: int, took: float, length: int) -> None:
        """A read of `length` bytes from `node` took `took` s: if that makes the peer slow
        (SlowPeers says why), it is asked last for SLOW_SECONDS, in every process of the
        node."""
        why = self._slow_peers.timed(node, took, length)
        if why is None:
            return
        log.warning("peer %s %s; reading from the other owners first for %.0f s",
                    self.view.nodes[node].name, why, SLOW_SECONDS)
        self._node_slow[node] = until = time.monotonic() + SLOW_SECONDS
        self.marks.down(node, until, why)

    def _peer_failed(self, node: int, err: PeerError) -> None:
        """A miss just means "not staged there"; anything else marks the peer down (for
        a moment only if it looks like a daemon not up yet)."""
        if isinstance(err, PeerMiss):  # it answered: usable again by the node's processes
            if self._node_down[node]:
                self._node_down[node] = 0.0
            return
        if isinstance(err, PeerUnreachable) and node not in self._answered \
                and time.monotonic() - self.started < STARTUP_SECONDS:
            if node not in self._starting_logged:
                self._starting_logged.add(node)
                log.info("peer %s is not up yet (%s); reading elsewhere, asking it again "
                         "every %g s", self.view.nodes[node].name, err, STARTING_DOWN_SECONDS)
            until = time.monotonic() + STARTING_DOWN_SECONDS
            self._down_until[node] = until
            self._node_down[node] = until
            self.marks.down(node, until, f"not up yet ({err})")
            return
        what = "unavailable" if isinstance(err, PeerUnavailable) else "refused a read"
        self._mark_down(node, f"{what} ({err})")

    def fetch_counters(self) -> dict[str, int]:
        """The node's peer fetches (every process's): what came from peers, what was
        shared between processes instead of fetched again (`dlfs status`)."""
        return self.share.counters() if self.share is not None else {}

    def _accept(self, node: int, ds: int, chunk: int, data: bytes | memoryview, length: int,
                expected: int) -> bool:
        """Peer bytes count only if they match the manifest checksum (the caller deals
        with a bad copy: same length, other bytes)."""
        if self.share is not None:
            self.share.count_fetch(len(data))
        if node not in self._answered:
            self._answered.add(node)
        if self._node_down[node]:  # it answered: the node's processes may use it again
            self._node_down[node] = 0.0
        if len(data) == length and checksum(data) == expected:
            if self._bad_copies:  # good again (re-staged there): forget its strikes
                self._bad_copies.pop((node, ds, chunk), None)
            return True
        if len(data) != length:  # the clients check lengths; a peer this broken is down
            self._mark_down(node, f"sent {len(data)} bytes for a read of {length}")
        return False

    def _bad_copy(self, node: int, ds: int, chunk: int, reported: bool) -> None:
        """Read that chunk elsewhere for a while. A reported copy is re-staged there at
        once, so the peer is tried again soon, later each time it is still bad."""
        strikes = self._bad_copies.get((node, ds, chunk), _NO_MARK)[1]
        seconds = BAD_COPY_SECONDS
        if reported:
            seconds = min(REPORTED_BAD_SECONDS * 2.0 ** min(strikes, 16), BAD_COPY_SECONDS)
        log.warning("peer %s sent bytes of chunk %d of dataset %s that fail their checksum "
                    "(a bad staged copy there); %s, reading that chunk elsewhere for %.0f s",
                    self.view.nodes[node].name, chunk, self.datasets[ds].name,
                    "reported it" if reported else "not reported", seconds)
        self._bad_copies[(node, ds, chunk)] = (until := time.monotonic() + seconds, strikes + 1)
        self.marks.bad_copy(node, ds, chunk, until)

    def _client(self, node: int) -> BlockingPeerClient:
        """This thread's client of `node`: the process's own in its main thread (one
        shared receive buffer), one with a buffer of its own in any other thread."""
        if threading.get_ident() == self._owner:
            clients, own = self._clients, False
        else:
            mine: dict[int, BlockingPeerClient] | None = getattr(self._threads, "clients", None)
            if mine is None:
                mine = self._threads.clients = {}
            clients, own = mine, True
        client = clients.get(node)
        if client is None:
            peer = self.view.nodes[node]
            client = BlockingPeerClient(self.view.secret, self.view.me.name, peer.host,
                                        peer.port, timeout=self.peer_timeout,
                                        alt_ports=peer.alt_ports, own_buffer=own)
            clients[node] = client
            if own:
                self._thread_clients.append(client)
        return client

    def _mark_down(self, node: int, why: str) -> None:
        """Skip `node` for DOWN_SECONDS, in every process of the node."""
        if self._down_until.get(node, 0.0) <= time.monotonic():
            log.warning("peer %s %s; using replicas or the store for %.0f s",
                        self.view.nodes[node].name, why, DOWN_SECONDS)
        self._down_until[node] = until = time.monotonic() + DOWN_SECONDS
        self._node_down[node] = until
        self.marks.down(node, until, why)

    # -- ChunkProvider for the peer server ------------------------------------------------
    def chunk_limit(self, dataset_id: bytes, chunk: int) -> int | None:
        ds = self._by_id.get(dataset_id)
        if ds is None or not 0 <= chunk < self.datasets[ds].chunk_count:
            return None
        return int(self.datasets[ds].chunk_lengths[chunk])

    def staged_file(self, dataset_id: bytes, chunk: int) -> tuple[int, int] | None:
        """(fd, data position) of the staged copy for the peer server (dlfsd.pool.peerserver,
        which reads from it); None if it is not staged, and then it is staged next."""
        ds = self._by_id[dataset_id]
        fd = self.caches[ds].fd(chunk)
        if fd < 0:
            if self.owned[ds][chunk]:
                self.demand.send(ds, chunk)  # a peer needs it: stage it next
            return None
        return fd, CHUNK_HEADER_SIZE

    def will_stage(self, dataset_id: bytes, chunk: int) -> bool:
        """See BlockingChunkProvider.will_stage: the stager decides (set_stager)."""
        ds = self._by_id.get(dataset_id)
        return ds is not None and self._will_stage(ds, chunk)

    def set_stager(self, will_stage: WillStage) -> None:
        """`will_stage(ds, chunk)`: whether the stager will stage that chunk soon; called
        from the peer server's thread."""
        self._will_stage = will_stage

    def staged_copy_failed(self, dataset_id: bytes, chunk: int, fd: int) -> bool:
        """The peer server could not read the staged copy through `fd` (-1: it could
        not open it): evict it and, if this node owns the chunk, stage it again (what a
        reader does with a copy it cannot read). A copy staged anew since `fd` was
        handed out is left alone: a read of the old one can fail late (a failing disk
        retries for seconds). True if a copy was evicted. Peers meanwhile get MISS and
        read elsewhere."""
        ds = self._by_id.get(dataset_id)
        return ds is not None and self.evict_copy(ds, chunk, fd)

    # -- checking copies: reports of peers, --verify-served, the scrub ----------------------
    def extents_in(self, ds: int, chunk: int, offset: int, length: int) -> range:
        """The extents of a chunk that overlap its data range [offset, offset+length):
        a range of extent indices (dlfs.store.layout packs a chunk's extents back to
        back, in extent order), found by bisecting the chunk's offsets (no copy)."""
        bounds = self._chunk_extents[ds]
        d = self.datasets[ds]
        if bounds is None:  # the server's (main) process only, on first use
            chunks = d.directory.arrays["ext_chunk"]
            if len(chunks) > 1 and bool((np.diff(chunks.astype(np.int64)) < 0).any()):
                raise ValueError(f"dataset {d.name}: extents are not in chunk order")
            bounds = self._chunk_extents[ds] = np.searchsorted(
                chunks, np.arange(d.chunk_count + 1), side="left").tolist()
        lo, hi = bounds[chunk], bounds[chunk + 1]
        offsets = d.directory.arrays["ext_offset"][lo:hi]
        first = max(int(np.searchsorted(offsets, offset, side="right")) - 1, 0)
        end = int(np.searchsorted(offsets, offset + length, side="left"))
        return range(lo + first, lo + end)

    def check_copy(self, dataset_id: bytes, chunk: int, offset: int, length: int) -> bool | None:
        """A peer reported bytes of this range bad: check the extents it overlaps in our
        staged copy; a bad one evicts the copy and stages it again. True if evicted,
        False if the copy checks out, None if there is no copy to check. Blocks (disk)."""
        ds = self._by_id.get(dataset_id)
        if ds is None:
            return None
        fd = self.caches[ds].fd(chunk)
        if fd < 0:
            return None
        if self.copy_is_good(ds, fd, self.extents_in(ds, chunk, offset, length)):
            return False
        return self.evict_copy(ds, chunk, fd)

    def copy_is_good(self, ds: int, fd: int, extents: Iterable[int]) -> bool:
        """Whether `extents` of the staged copy open at `fd` match their checksums (a
        copy cut short, or one the disk cannot read, does not). Blocks."""
        d = self.datasets[ds].directory
        for ext in extents:
            length = int(d.ext_length_view[ext])
            try:
                data = os.pread(fd, length, CHUNK_HEADER_SIZE + int(d.ext_offset_view[ext]))
            except OSError:
                return False
            if len(data) != length or checksum(data) != d.ext_checksum_view[ext]:
                return False
        return True

    def serve_check(self, dataset_id: bytes, chunk: int, offset: int,
                    length: int) -> tuple[int, int, int] | None:
        """--verify-served: (extent, expected checksum, copy generation) if a READ of
        this range is one whole extent the current staged copy has not served since it
        was staged; None if there is nothing to check (served before, not one extent)."""
        ds = self._by_id[dataset_id]
        gen = self.caches[ds].generation(chunk)
        if not gen:
            return None
        exts = self.extents_in(ds, chunk, offset, length)
        d = self.datasets[ds].directory
        if len(exts) != 1:
            return None
        ext = int(exts[0])
        if d.ext_offset_view[ext] != offset or d.ext_length_view[ext] != length:
            return None
        if self._checked[ds][ext] == gen:
            return None
        return ext, int(d.ext_checksum_view[ext]), gen

    def served_checked(self, dataset_id: bytes, ext: int, gen: int) -> None:
        """The extent checked out as copy generation `gen` served it (the one serve_check
        named: a copy staged anew since is checked on its own): not again for it."""
        checked = self._checked[self._by_id[dataset_id]]
        if checked is not None:  # (serve_check, which named it, made it)
            checked[ext] = gen

    def evict_copy(self, ds: int, chunk: int, fd: int) -> bool:
        """Drop the staged copy read through `fd`, which failed, and if this node owns
        the chunk stage it again next; True if evicted. Only if `fd` is still the
        current copy's: a slow read of an old copy can fail after that copy was evicted
        and staged anew, and the new good copy must stay. -1 (it could not be opened:
        out of descriptors, permissions) is not the copy's fault, and a copy that is
        gone is forgotten on opening (ChunkCache.open_fd)."""
        cache = self.caches[ds]
        if fd < 0 or not cache.is_staged(chunk) or cache.cached_fd(chunk) != fd:
            return False
        cache.evict(chunk)
        if self.owned[ds][chunk]:
            self.demand.send(ds, chunk)
        return True


if TYPE_CHECKING:  # the seam ChunkPool fills for the peer server (mypy checks it, never run)
    def _serves_peers(pool: ChunkPool) -> BlockingChunkProvider:
        return pool

def _shared_bytes(count: int) -> mmap.mmap:
    """`count` zero bytes in anonymous shared memory: what one process of the daemon
    writes, a process forked after it was made sees."""
    return mmap.mmap(-1, max(1, count))

"""PeerShare: one peer fetch per extent per node, shared by all the daemon's processes.

Why: the kernel's read-ahead cuts a large file into 1 MiB requests and hands
them to whichever worker process reads /dev/fuse next, so the four parts of
one 4 MiB extent reach four workers at once. A peer serves whole extents
(bytes are checked against the extent's checksum, which needs all of them),
and each worker used to fetch the whole extent itself and keep it in a
private LRU: two to four times the peer traffic of the bytes needed.

How: everything lives in memory made before the workers fork.

* A buffer of `slots` extent-sized slots (an anonymous shared mapping) holds
  recently fetched whole extents, already checked, with a small table per
  slot (key, length, last use) and a direct-mapped index key -> slot.
* A memfd used only for fcntl record locks:
  - the slot lock (byte `s`): shared while a process copies out of slot `s`,
    exclusive while one fills it, so a copy is never torn and a slot is never
    refilled under a reader (a reader that finds it being refilled fetches);
  - the fetch lock (byte FETCH_LOCKS + key): held by the one process fetching
    extent `key`; another that needs the extent waits for it (bounded) and
    then copies its part out of the slot.
  Why record locks and not a LOADING bit in the per-extent state bytes: taking
  a lock is atomic (a shared byte's test-and-set is not, across processes: two
  workers could both see the bit clear and both fetch), and the kernel drops a
  process's locks when it dies, so a worker killed mid-fetch leaves nothing
  behind for the others to wait on.
* Notes by key hash: "a process is waiting for this extent" (a fetcher of a
  whole-extent read keeps its bytes in a slot only then: nobody else needs
  them otherwise) and "the last fetch of this extent failed" (a waiter that
  then gets the lock goes to the store at once instead of trying the same
  peers again, one process after the other).
* An in-flight note by key hash, set by the holder of an extent's fetch lock:
  a read of a whole extent (a small file) that finds no note fetches without
  the lock (two fcntl calls less per read; see PeerShare._read_whole).
* Counters per process (rows, as in dlfsd.obs.stats), summed on reading.

What the look-ahead fetches ahead stays until a reader takes it: its slot is
pinned (its last-use time set AHEAD_PIN_SECONDS into the future, so the least
recently used slot is never one of them) until the first copy out of it, and
no store evicts a pinned slot. The look-ahead asks `ahead_room` before it moves
its window on: a slot budget smaller than its window (each extent takes a slot
of the largest extent's size, and the budget is counted in bytes) once let it
fetch far past what the slots hold, evicting its own unread extents, which the
readers then fetched again: twice the peer traffic (measured: 4,261 fetches for
2,384 samples, 0 shared reads, bench/lookahead_peer.py --read 8).

Record locks belong to a process: two threads of one process (the look-ahead's
fetch threads, which prefetch in parallel) would both get the same lock. So a
process's threads also take one in-process lock around filling or copying a
slot, and `prefetch` keeps the extents its threads are fetching in a set.

"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from dlfsd.base.buffers import lazy_buffer
from dlfsd.base.slots import ProcessSlot

#: Bytes of whole extents kept for the node (they were 64 MiB per worker process), besides
#: what the look-ahead keeps for the readers (ChunkPool's `ahead`).
SHARE_BYTES = 64 << 20
MIN_SLOTS = 8  # room for every worker's extent in flight, even with 4 MiB extents
MAX_SLOTS = 1024  # small extents: the index stays sparse, victims quick to find
INDEX = 4096  # direct-mapped index entries (key -> slot); a collision is a miss
NOTES = 1024  # "wanted" and "failed" notes, by key hash; a collision loses one
FETCH_LOCKS = 1 << 20  # lock offsets from here on: one fetch lock per extent key
FAILED_NOTE_NS = 1_000_000_000  # a failed fetch sends waiters to the store for 1 s
# Seconds between tries of a fetch lock another process holds: the first tries come
# soon (a 110 KiB extent from a peer lands in ~0.1 ms, and a sleep overshoots by ~50 us),
# then each gap doubles up to POLL: a long wait (a large extent, a slow peer) costs a
# try per 0.2 ms, a short one is not made 0.2 ms long.
FIRST_POLL = 0.00002
POLL = 0.0002
# How long a read of a whole extent (a small file) waits for another's fetch of it
# before it fetches the extent itself. A fetch that lands in time is shared; one that
# takes longer is queued behind others (the look-ahead's pipelined rounds, its fetch
# threads contending in one process), and a fetch of our own then costs the node less
# than the rest of the wait: the look-ahead must never make a reader slower than
# reading alone (a 16-core node, 8 readers: the waits held an announced epoch to a
# third of the rate without them, bench/lookahead_peer.py --read 8).
WHOLE_WAIT = 0.002
# An extent fetched ahead and never read (its sample skipped, its stream abandoned) frees
# its slot after this. Readers take what is fetched ahead within a fraction of a second
# (the window holds no more than the slots); pinned slots left by an abandoned stream
# hold the next stream's window back until they expire, so not the look-ahead's 60 s
# stale time: 15 s. Readers slower than room / 15 s (64 slots: ~4 samples/s) may find
# an extent evicted and fetch it again, which at that pace costs little.
AHEAD_PIN_SECONDS = 15.0
_BUSY = (errno.EACCES, errno.EAGAIN)

COUNTERS = ("fetches", "fetched_bytes", "shared_reads", "shared_bytes", "waits",
            "wait_timeouts", "stored", "wait_us", "whole_waits_cut")
# wait_us: time waiting, all waits; whole_waits_cut: whole-extent reads that stopped
# waiting after `whole_wait` and fetched the extent themselves
(_FETCHES, _FETCHED_BYTES, _SHARED_READS, _SHARED_BYTES, _WAITS, _WAIT_TIMEOUTS,
 _STORED, _WAIT_US, _WHOLE_WAITS_CUT) = range(len(COUNTERS))


# A whole extent fetched from an owner peer, checked, or None (ChunkPool.fetch, called
# as fetch(*args)): what PeerShare.read and prefetch are handed.
Fetch = Callable[..., "bytes | memoryview | None"]
# Several whole extents fetched, each handed to the callback once, checked, or None
# (ChunkPool.fetch_many): what prefetch_many is handed.
FetchMany = Callable[[Sequence, Callable[[int, "bytes | memoryview | None"], None]], None]
# Told by prefetch_many of each extent as it lands: (its place in the batch, what
# `prefetch` would return for it).
Landed = Callable[[int, "int | None"], None]


def extent_key(ds: int, ext: int) -> int:
    """One number per (dataset, extent) of a mount: the slot table's key."""
    return (ds << 40) | ext


def _spot(key: int, size: int) -> int:
    """Where `key` goes in a direct-mapped table of `size`: extent n of two datasets
    must not always land on the same spot."""
    return ((key >> 40) * 40503 + key) % size


class PeerShare:
    """Whole peer extents and in-flight peer fetches, shared by forked processes."""

    def __init__(self, slot_size: int, wait: float, processes: int = 1,
                 budget: int = SHARE_BYTES, whole_wait: float = WHOLE_WAIT) -> None:
        """`slot_size`: the largest extent of the mount; `wait`: seconds a process
        waits for another's fetch before fetching itself (a fetch's own bound);
        `whole_wait`: the same for a read of a whole extent (WHOLE_WAIT)."""
        self.whole_wait = min(wait, whole_wait)
        self.slot_size = max(1, slot_size)
        self.slots = max(MIN_SLOTS, min(MAX_SLOTS, budget // self.slot_size))
        # the part of the slots the readers keep for themselves (what SHARE_BYTES gives)
        self._readers_slots = min(self.slots // 2,
                                  max(MIN_SLOTS, min(budget, SHARE_BYTES) // self.slot_size))
        self._pin_ns = int(AHEAD_PIN_SECONDS * 1e9)
        self.wait = wait
        self._slot = ProcessSlot(processes)
        self._buffer = mmap.mmap(-1, self.slots * self.slot_size)
        self._data = memoryview(self._buffer)
        rows = self._slot.count
        words = 3 * self.slots + 4 * NOTES + rows * len(COUNTERS)
        self._meta = mmap.mmap(-1, 8 * words + 4 * INDEX)
        table = np.frombuffer(self._meta, dtype=np.int64, count=words)
        s = self.slots
        self._keys, self._lengths, self._used = table[:s], table[s : 2 * s], table[2 * s : 3 * s]
        notes = table[3 * s : 3 * s + 4 * NOTES]
        self._wanted, self._failed_key, self._failed_until, self._in_flight = (
            notes[:NOTES], notes[NOTES : 2 * NOTES], notes[2 * NOTES : 3 * NOTES],
            notes[3 * NOTES :])
        self._counts = table[3 * s + 4 * NOTES :].reshape(rows, len(COUNTERS))
        self._index = np.frombuffer(self._meta, dtype=np.int32, count=INDEX, offset=8 * words)
        self._keys[:] = -1
        self._wanted[:] = -1
        self._in_flight[:] = -1
        self._failed_key[:] = -1
        self._index[:] = -1
        self._locks = os.memfd_create("dlfs-peer-share", os.MFD_CLOEXEC)
        self._scratch: memoryview | None = None  # per process: hits handed to a worker
        self._inproc = threading.Lock()  # this process's threads, one slot at a time
        self._fetching: set[int] = set()  # extents this process's threads prefetch now

    def close(self) -> None:
        # Drop the arrays over the mappings so those can close (a closed share is never
        # read again; None makes a stray use fail loudly).
        self._keys = self._lengths = self._used = self._wanted = self._in_flight = None  # type: ignore[assignment]
        self._failed_key = self._failed_until = self._counts = self._index = None  # type: ignore[assignment]
        self._data.release()
        self._buffer.close()
        self._meta.close()
        with contextlib.suppress(OSError):
            os.close(self._locks)

    # -- the read path: one request at a time per process, blocking -----------------------
    def read(self, key: int, rel: int, length: int, lasting: bool,
             fetch: Fetch, *args: object, whole: bool = False) -> bytes | memoryview | None:
        """`length` bytes at `rel` of extent `key`: from a slot, else from the node's one
        fetch of it (`fetch(*args)`: the whole extent, checked, or None), else None.

        Without `lasting` the bytes may be a view valid until this process's next read.
        `whole`: the read asks for the whole extent (a small file read in one request):
        unless another process is fetching it now, it is fetched without the fetch
        lock (see _read_whole).
        """
        data = self.copy_out(key, rel, length, lasting)
        if data is not None:
            return data
        if whole and self._in_flight[_spot(key, NOTES)] != key:
            return self._read_whole(key, lasting, fetch, args)
        holding = self._try_lock(FETCH_LOCKS + key, exclusive=True)
        if not holding:  # another process fetches it: wait, then take our part
            holding = self._wait_for_fetch(key, self.whole_wait if whole else self.wait)
            data = self.copy_out(key, rel, length, lasting)
            if data is not None or (holding and self._failed_recently(key)):
                self._release_fetch(key, holding)
                return data
        else:  # its fetch may have ended between our look and the lock
            data = self.copy_out(key, rel, length, lasting)
            if data is not None:
                self._release_fetch(key, True)
                return data
        if holding:
            self._in_flight[_spot(key, NOTES)] = key
        try:
            extent = fetch(*args)
            if extent is None:
                self._note_failed(key)
                return None
            if length < len(extent) or self._wanted[_spot(key, NOTES)] == key:
                self.store(key, extent)
        finally:
            self._release_fetch(key, holding)
        if rel or length < len(extent):
            extent = memoryview(extent)[rel : rel + length]
        return bytes(extent) if lasting else extent

    def _read_whole(self, key: int, lasting: bool, fetch: Fetch,
                    args: tuple) -> bytes | memoryview | None:
        """A whole-extent read that nobody else is fetching: fetched at once, no lock.

        Why: the fetch lock costs two fcntl calls and a second look at the slots, ~7% of
        a remote small-file read's CPU on a busy reading node (bench/pool_read.py
        --pin), and a small file is read whole by one request, so another process
        rarely wants the same extent at the same moment. If one does and gets there
        second, it sees the in-flight note and waits for this fetch as before (when
        the note came first), or both fetch (when both looked at the same moment: one
        extent more over the wire, nothing worse). A process waiting on the locked
        path still gets the bytes kept for it (its `wanted` note)."""
        got = fetch(*args)
        if got is None:
            self._note_failed(key)
            return None
        if self._wanted[_spot(key, NOTES)] == key:
            self.store(key, got)
        return bytes(got) if lasting else got

    def prefetch(self, key: int, fetch: Fetch, *args: object) -> int | None:
        """The look-ahead: fetch extent `key` (`fetch(*args)`, as `read` does) into a slot
        before any reader asks for it. Returns its length when a slot holds it (fetched
        now or before), 0 when another process is fetching it (the readers get it from
        that fetch) or no slot was free, None when no peer served it (the caller reads
        it elsewhere)."""
        held = self._slot_length(key)
        if held:
            return held
        with self._inproc:
            if key in self._fetching:  # another thread of ours fetches it
                return 0
            self._fetching.add(key)
        try:
            if not self._try_lock(FETCH_LOCKS + key, exclusive=True):
                return 0
            try:
                held = self._slot_length(key)  # its fetch ended between our look and the lock
                if held:
                    return held
                self._in_flight[_spot(key, NOTES)] = key
                whole = fetch(*args)
                if whole is None:
                    return None
                return len(whole) if self.store(key, whole, ahead=True) else 0
            finally:
                self._fetch_done(key)
        finally:
            with self._inproc:
                self._fetching.discard(key)

    def prefetch_many(self, keys: Sequence[int], fetch_many: FetchMany,
                      reads: Sequence, landed: Landed | None = None) -> list[int | None]:
        """`prefetch` for several extents at once: those no slot holds and nobody else
        fetches are claimed as `prefetch` claims one (this process's set, the fetch
        lock, the in-flight note) and fetched together, `fetch_many(their reads,
        on_fetched)` (pipelined to each owner: ChunkPool.fetch_many); each claim is
        let go as soon as its extent is stored (after `landed(i, result)`, so what the
        caller notes of it is there before a waiting reader reads it), so a reader
        waiting for it does not wait for the rest of the batch. Per key what
        `prefetch` returns."""
        results: list[int | None] = [0] * len(keys)
        claimed = [i for i, key in enumerate(keys) if self._claim(key, results, i)]
        held = [True] * len(claimed)

        def on_fetched(j: int, whole: bytes | memoryview | None) -> None:
            i = claimed[j]
            if whole is not None:
                results[i] = len(whole) if self.store(keys[i], whole, ahead=True) else 0
            else:
                results[i] = None
            if landed is not None:
                landed(i, results[i])
            held[j] = False
            self._unclaim(keys[i])

        try:
            if claimed:
                fetch_many([reads[i] for i in claimed], on_fetched)
        finally:
            for j, i in enumerate(claimed):
                if held[j]:
                    self._unclaim(keys[i])
        return results

    def _claim(self, key: int, results: list[int | None], i: int) -> bool:
        """prefetch_many: take the fetch of `key` (True), or set results[i] to what a
        slot holds of it (left 0 when another thread or process fetches it)."""
        held = self._slot_length(key)
        if held:
            results[i] = held
            return False
        with self._inproc:
            if key in self._fetching:
                return False
            self._fetching.add(key)
        if not self._try_lock(FETCH_LOCKS + key, exclusive=True):
            with self._inproc:
                self._fetching.discard(key)
            return False
        held = self._slot_length(key)  # its fetch ended between our look and the lock
        if held:
            results[i] = held
            self._unclaim(key)
            return False
        self._in_flight[_spot(key, NOTES)] = key
        return True

    def _unclaim(self, key: int) -> None:
        self._fetch_done(key)
        with self._inproc:
            self._fetching.discard(key)

    def _wait_for_fetch(self, key: int, bound: float) -> bool:
        """Wait until the process fetching `key` is done (or died: its lock goes with it),
        at most `bound` seconds; True if we hold the fetch lock now."""
        self._wanted[_spot(key, NOTES)] = key  # keep the bytes for us, even a whole-extent read
        self.count(_WAITS)
        started = time.monotonic()
        deadline, pause = started + bound, FIRST_POLL
        try:
            while time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(POLL, 2 * pause)
                if self._try_lock(FETCH_LOCKS + key, exclusive=True):
                    return True
            # a stuck (stopped?) fetcher, or for a whole extent one that takes longer than
            # a fetch of our own: fetch it ourselves (kept for the others: our note)
            self.count(_WAIT_TIMEOUTS if bound >= self.wait else _WHOLE_WAITS_CUT)
            return False
        finally:
            self.count(_WAIT_US, int((time.monotonic() - started) * 1e6))

    def _release_fetch(self, key: int, holding: bool) -> None:
        if holding:
            if self._wanted[_spot(key, NOTES)] == key:
                self._wanted[_spot(key, NOTES)] = -1
            self._fetch_done(key)

    def _fetch_done(self, key: int) -> None:
        """Drop the fetch lock of `key` and its in-flight note (if no other key's fetch
        took the note's place meanwhile). A fetcher that dies leaves its note: the next
        whole-extent reader of that key then takes the locked path, which is free."""
        note = _spot(key, NOTES)
        if self._in_flight[note] == key:
            self._in_flight[note] = -1
        self._unlock(FETCH_LOCKS + key)

    def _note_failed(self, key: int) -> None:
        note = _spot(key, NOTES)
        self._failed_key[note] = key
        self._failed_until[note] = time.monotonic_ns() + FAILED_NOTE_NS

    def _failed_recently(self, key: int) -> bool:
        note = _spot(key, NOTES)
        return self._failed_key[note] == key and self._failed_until[note] > time.monotonic_ns()

    # -- slots --------------------------------------------------------------------------
    def copy_out(self, key: int, rel: int, length: int,
                 lasting: bool) -> bytes | memoryview | None:
        """`length` bytes at `rel` of extent `key` if a slot holds it, else None. A slot
        being refilled right now counts as a miss. `lasting`: a new bytes object; else a
        view of this process's scratch buffer, valid until its next copy_out."""
        slot = int(self._index[_spot(key, INDEX)])
        if slot < 0 or self._keys[slot] != key:
            return None
        with self._inproc:
            return self._copy_out_locked(key, slot, rel, length, lasting)

    def _copy_out_locked(self, key: int, slot: int, rel: int, length: int,
                         lasting: bool) -> bytes | memoryview | None:
        if not self._try_lock(slot, exclusive=False):
            return None
        try:
            if self._keys[slot] != key or rel + length > self._lengths[slot]:
                return None
            start = slot * self.slot_size + rel
            data: bytes | memoryview
            if lasting:
                data = self._data[start : start + length].tobytes()
            else:
                data = self._scratch_view()[:length]
                data[:] = self._data[start : start + length]
            self._used[slot] = time.monotonic_ns()
        finally:
            self._unlock(slot)
        self.count(_SHARED_READS)
        self.count(_SHARED_BYTES, length)
        return data

    def store(self, key: int, data: bytes | memoryview, ahead: bool = False) -> bool:
        """Keep a checked whole extent for the node's other reads of it: in an empty or
        the least recently used slot nobody is copying from and no unread extent
        fetched ahead pins. False if none was free. `ahead`: fetched by the
        look-ahead, so pinned until a reader copies out of it (see the module's
        docstring)."""
        length = len(data)
        if length > self.slot_size or self.copy_slot(key) >= 0:
            return False
        with self._inproc:
            return self._store_locked(key, data, length, ahead)

    def ahead_room(self) -> int:
        """Slots that a store may fill now without evicting an unread extent fetched
        ahead, less the readers' own part of the budget (what a node shares with
        no look-ahead): how many more extents the look-ahead may fetch ahead."""
        free = int(np.count_nonzero(self._used <= time.monotonic_ns()))
        return free - self._readers_slots

    def _store_locked(self, key: int, data: bytes | memoryview, length: int,
                      ahead: bool) -> bool:
        now = time.monotonic_ns()
        for slot in np.argsort(self._used)[:4].tolist():  # empty slots first (used 0)
            if self._used[slot] > now:  # pinned, and so is every slot after it
                return False
            if not self._try_lock(slot, exclusive=True):
                continue
            try:
                self._keys[slot] = -1  # not findable while its bytes change
                start = slot * self.slot_size
                self._data[start : start + length] = data
                self._lengths[slot] = length
                self._used[slot] = now + self._pin_ns if ahead else now
                self._keys[slot] = key
                self._index[_spot(key, INDEX)] = slot
            finally:
                self._unlock(slot)
            self.count(_STORED)
            return True
        return False

    def _slot_length(self, key: int) -> int:
        slot = self.copy_slot(key)
        return int(self._lengths[slot]) if slot >= 0 else 0

    def copy_slot(self, key: int) -> int:
        """The slot holding extent `key`, or -1."""
        slot = int(self._index[_spot(key, INDEX)])
        return slot if slot >= 0 and self._keys[slot] == key else -1

    def _scratch_view(self) -> memoryview:
        if self._scratch is None:  # made in the process that uses it, after the fork
            self._scratch = lazy_buffer(self.slot_size)
        return self._scratch

    # -- locks ---------------------------------------------------------------------------
    def _try_lock(self, offset: int, exclusive: bool) -> bool:
        kind = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.lockf(self._locks, kind | fcntl.LOCK_NB, 1, offset)
        except OSError as err:
            if err.errno in _BUSY:
                return False
            raise
        return True

    def _unlock(self, offset: int) -> None:
        fcntl.lockf(self._locks, fcntl.LOCK_UN, 1, offset)

    # -- counters --------------------------------------------------------------------------
    def count(self, counter: int, n: int = 1) -> None:
        self._counts[self._slot.index, counter] += n

    def count_fetch(self, nbytes: int) -> None:
        """A whole extent arrived from a peer (counted whether or not it checked out)."""
        self._counts[self._slot.index, _FETCHES] += 1
        self._counts[self._slot.index, _FETCHED_BYTES] += nbytes

    def counters(self) -> dict[str, int]:
        """The node's totals: every process's row summed."""
        totals = self._counts.sum(axis=0).tolist()
        out = dict(zip(COUNTERS, totals, strict=True))
        out["slots"], out["slot_bytes"] = self.slots, self.slot_size
        return out

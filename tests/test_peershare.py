"""PeerShare across real forked processes: one fetch per extent, bounded waits, no torn copy.

The fetch each test hands in stands for the peer (the real one is ChunkPool's,
tested through two daemons in test_pool.py); PeerShare itself, its shared
memory and its record locks are the real thing, in several real processes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import struct
import time

import pytest

from dlfsd.pool.peershare import MAX_SLOTS, MIN_SLOTS, PeerShare, extent_key

EXTENT = bytes(range(256)) * 4096  # 1 MiB, every byte's position visible
KEY = extent_key(1, 77)


class Calls:
    """How often the stand-in peer was asked, counted across processes."""

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, 8)

    @property
    def value(self) -> int:
        return struct.unpack_from("q", self._map)[0]

    def add(self) -> None:
        struct.pack_into("q", self._map, 0, self.value + 1)


def until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def fork(fn) -> int:
    """Run fn() in a child process that exits 0 if it returned True, else 1."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if fn() else 1
        finally:
            os._exit(code)
    return pid


def exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@contextlib.contextmanager
def fetching_elsewhere(share: PeerShare):
    """A process that fetches KEY (holding its fetch lock and in-flight note) from a
    peer that never answers, for the length of the block; SIGKILLed after it."""
    started = Calls()

    def stuck_peer():
        started.add()
        time.sleep(3600)

    pid = fork(lambda: share.read(KEY, 0, 10, True, stuck_peer) is not None)
    try:
        assert until(lambda: started.value == 1)
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def kill_mid_fetch(share: PeerShare) -> None:
    """A process that fetches KEY is SIGKILLed in the middle of its fetch."""
    with fetching_elsewhere(share):
        pass


@pytest.fixture
def share():
    share = PeerShare(len(EXTENT), wait=30.0, processes=8)
    yield share
    share.close()


def test_processes_reading_parts_of_one_extent_fetch_it_once(share):
    calls = Calls()
    parts = [(0, 4096), (300_000, 200_000), (len(EXTENT) - 10, 10)]

    def peer():
        calls.add()
        until(lambda: share.counters()["waits"] == len(parts) - 1)  # the others wait
        return EXTENT

    def read(rel: int, length: int) -> bool:
        got = share.read(KEY, rel, length, True, peer)
        return got == EXTENT[rel : rel + length]

    pids = [fork(lambda r=r, n=n: read(r, n)) for r, n in parts]
    assert [exit_code(pid) for pid in pids] == [0, 0, 0]
    counts = share.counters()
    assert calls.value == 1
    assert counts["waits"] == 2 and counts["shared_reads"] == 2 and counts["stored"] == 1
    # Later reads of the extent, by this process too, come from the slot.
    assert bytes(share.read(KEY, 5, 7, False, peer)) == EXTENT[5:12]
    assert calls.value == 1 and share.counters()["shared_reads"] == 3


def test_a_whole_extent_read_keeps_its_bytes_only_for_a_waiter(share):
    calls = Calls()

    def peer():
        calls.add()
        until(lambda: share.counters()["waits"] == 1)
        return EXTENT

    alone = share.read(extent_key(0, 1), 0, len(EXTENT), False, lambda: EXTENT)
    assert alone == EXTENT and share.counters()["stored"] == 0  # nobody else wanted it
    pids = [fork(lambda: share.read(KEY, 0, len(EXTENT), True, peer) == EXTENT)
            for _ in range(2)]
    assert [exit_code(pid) for pid in pids] == [0, 0]
    assert calls.value == 1 and share.counters()["stored"] == 1


def test_whole_extent_reads_nobody_is_fetching_take_no_lock_and_wait_for_nobody(share):
    """A small file is read whole by one request: with no fetch of it in flight its
    reader fetches at once (no fetch lock: two fcntl calls less per read). Two such
    readers at the same moment both fetch, neither waits: the price of the fast path
    (one extent more over the wire), and the bytes are right for both."""
    calls = Calls()

    def peer():
        calls.add()
        until(lambda: calls.value == 2, timeout=5.0)  # both are in their fetch at once
        return EXTENT

    pids = [fork(lambda: share.read(KEY, 0, len(EXTENT), True, peer, whole=True) == EXTENT)
            for _ in range(2)]
    assert [exit_code(pid) for pid in pids] == [0, 0]
    assert calls.value == 2
    counts = share.counters()
    assert counts["waits"] == 0 and counts["stored"] == 0  # nobody waited: nothing kept


def test_a_whole_extent_read_waits_for_a_fetch_in_flight_and_shares_it(share):
    """Another process holds the fetch (a partial reader, the look-ahead) and has noted
    it: the whole-extent reader waits for that one fetch and copies from its slot
    (here the fetch lands within a whole read's wait, made long for the test)."""
    share.whole_wait = 5.0
    calls = Calls()

    def peer():
        calls.add()
        until(lambda: share.counters()["waits"] == 1)
        return EXTENT

    pid = fork(lambda: share.read(KEY, 0, 4096, True, peer) == EXTENT[:4096])
    assert until(lambda: calls.value == 1)
    got = share.read(KEY, 0, len(EXTENT), True, lambda: None, whole=True)
    assert got == EXTENT and exit_code(pid) == 0
    assert calls.value == 1 and share.counters()["shared_reads"] == 1


def test_a_whole_extent_read_waits_briefly_then_fetches_itself(share):
    """A fetch in flight that takes longer than a fetch of our own would (the
    look-ahead's, queued behind others) holds a small file's read up for `whole_wait`
    only, not for the fetch's own bound; the bytes it fetched itself are kept, so the
    late fetch does not take a second slot."""
    share.whole_wait = 0.05
    with fetching_elsewhere(share):
        started = time.monotonic()
        got = share.read(KEY, 0, len(EXTENT), True, lambda: EXTENT, whole=True)
        took = time.monotonic() - started
        assert got == EXTENT and 0.05 <= took < 5.0  # share.wait is 30 s
        counts = share.counters()
        assert counts["whole_waits_cut"] == 1 and counts["wait_timeouts"] == 0
        assert share.copy_slot(KEY) >= 0
        assert not share.store(KEY, EXTENT, ahead=True)  # the late fetch: no slot


def test_a_note_left_by_a_dead_fetcher_costs_a_whole_read_no_wait(share):
    """A fetcher killed mid-fetch leaves its in-flight note but not its lock: the next
    whole-extent reader takes the locked path, finds the lock free and fetches."""
    kill_mid_fetch(share)
    assert share.read(KEY, 0, len(EXTENT), True, lambda: EXTENT, whole=True) == EXTENT
    assert share.counters()["wait_timeouts"] == 0
    assert share.read(KEY, 0, len(EXTENT), True, lambda: EXTENT, whole=True) == EXTENT


def test_a_fetcher_killed_mid_fetch_holds_up_nobody(share):
    """Its fetch lock dies with it: the next process fetches at once, no wait runs out."""
    kill_mid_fetch(share)
    calls = Calls()

    def peer():
        calls.add()
        return EXTENT

    assert share.read(KEY, 0, 10, True, peer) == EXTENT[:10]
    assert calls.value == 1 and share.counters()["wait_timeouts"] == 0


def test_a_fetcher_that_hangs_is_waited_for_a_bounded_time(share):
    share.wait = 0.3
    with fetching_elsewhere(share):
        assert share.read(KEY, 100, 10, True, lambda: EXTENT) == EXTENT[100:110]
        assert share.counters()["wait_timeouts"] == 1


def test_a_failed_fetch_sends_its_waiters_elsewhere_at_once(share):
    """The peers just failed this extent: a waiter goes to the store instead of asking
    them again (one process after the other, each up to its timeout)."""
    asked, started = Calls(), Calls()

    def failing_peer():
        started.add()
        until(lambda: share.counters()["waits"] == 1)
        return None

    def second_peer():
        asked.add()
        return EXTENT

    pid = fork(lambda: share.read(KEY, 0, 10, True, failing_peer) is None)
    assert until(lambda: started.value == 1)
    assert share.read(KEY, 0, 10, True, second_peer) is None
    assert exit_code(pid) == 0 and asked.value == 0


def test_a_slot_another_process_copies_from_is_never_refilled(share):
    """A copy out of a slot holds it (shared lock): a store needing room takes another
    slot, so the copy is never torn."""
    assert share.store(KEY, EXTENT)
    slot = share.copy_slot(KEY)
    held, release = os.pipe(), os.pipe()

    def hold() -> bool:  # what copy_out does around its copy, held open
        assert share._try_lock(slot, exclusive=False)
        os.write(held[1], b"x")
        os.read(release[0], 1)
        return True

    pid = fork(hold)
    try:
        assert os.read(held[0], 1) == b"x"
        for ext in range(2 * share.slots):  # more than fit: every other slot is refilled
            other = bytes([ext % 251]) * len(EXTENT)
            share.store(extent_key(1, 1000 + ext), other)
        assert share.copy_slot(KEY) == slot
        # Copies may run side by side (shared locks); its bytes are the extent's still.
        assert share.copy_out(KEY, 0, len(EXTENT), True) == EXTENT
    finally:
        os.write(release[1], b"x")
        assert exit_code(pid) == 0
        for fd in (*held, *release):
            os.close(fd)


def test_slots_follow_the_budget_within_bounds():
    sizes = (16 << 10, 128 << 10, 4 << 20)  # 4096 slots' worth (capped), 512, 16
    shares = [PeerShare(size, wait=1.0, budget=64 << 20) for size in sizes]
    huge = PeerShare(4 << 20, wait=1.0, budget=4 << 20)
    try:
        assert [s.slots for s in shares] == [MAX_SLOTS, 512, 16] and huge.slots == MIN_SLOTS
    finally:
        for s in (*shares, huge):
            s.close()


def test_threads_of_one_process_prefetch_each_extent_once_and_never_tear_a_slot():
    """Record locks are the process's: the look-ahead's fetch threads, prefetching in
    parallel, must still fetch an extent once and fill each slot one at a time."""
    import threading

    share = PeerShare(64 << 10, wait=5.0, budget=MIN_SLOTS * (64 << 10))
    in_flight: set[int] = set()
    twice: list[int] = []  # keys fetched by two threads at once
    gate = threading.Barrier(4)

    def fetch(key: int) -> bytes:
        if key in in_flight:
            twice.append(key)
        in_flight.add(key)
        time.sleep(0.02)  # the other threads arrive while this fetch is under way
        in_flight.discard(key)
        return bytes([key % 251]) * (64 << 10)

    def worker(offset: int) -> None:
        gate.wait()
        for i in range(3 * MIN_SLOTS):
            key = extent_key(0, (i + offset) % (3 * MIN_SLOTS))
            share.prefetch(key, fetch, key)

    try:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert twice == []
        for ext in range(3 * MIN_SLOTS):  # whatever a slot holds is whole and its own
            key = extent_key(0, ext)
            data = share.copy_out(key, 0, 64 << 10, lasting=True)
            assert data is None or data == bytes([key % 251]) * (64 << 10)
    finally:
        share.close()


def test_extents_fetched_ahead_stay_until_read_and_room_says_how_many_more_fit():
    """What the look-ahead prefetches pins its slot until a reader copies out of it:
    later stores, its own or the readers', never evict it (they fail instead), and
    ahead_room counts down to 0 as the slots fill, then up again as readers take them."""
    size = 64 << 10
    share = PeerShare(size, wait=5.0, budget=4 * MIN_SLOTS * size)  # 32 slots
    try:
        readers_part = share.slots - share.ahead_room()
        assert 0 < readers_part < share.slots
        keys = [extent_key(0, i) for i in range(share.slots)]
        for n, key in enumerate(keys):
            assert share.prefetch(key, lambda k: bytes([k % 251]) * size, key) == size
            assert share.ahead_room() == share.slots - readers_part - n - 1
        assert share.ahead_room() == -readers_part  # every slot pinned
        late = extent_key(1, 0)
        assert share.prefetch(late, lambda: b"x" * size) == 0  # no slot: left to readers
        assert not share.store(late, b"x" * size)  # nor for a reader's own fetch
        for key in keys:  # none was evicted
            assert share.copy_out(key, 0, 16, lasting=True) == bytes([key % 251]) * 16
        assert share.ahead_room() == share.slots - readers_part  # read: unpinned
        assert share.store(late, b"x" * size)
    finally:
        share.close()


def test_an_extent_fetched_ahead_and_never_read_frees_its_slot_after_its_pin():
    """A stream abandoned mid-window leaves unread extents: their slots come back once
    the pin runs out (AHEAD_PIN_SECONDS; shortened here to 0.2 s for the test)."""
    size = 64 << 10
    share = PeerShare(size, wait=5.0, budget=MIN_SLOTS * size)
    share._pin_ns = 200_000_000
    try:
        for i in range(share.slots):
            assert share.prefetch(extent_key(0, i), lambda: b"a" * size) == size
        assert not share.store(extent_key(1, 0), b"b" * size)  # all pinned
        time.sleep(0.3)
        assert share.ahead_room() > 0
        assert share.store(extent_key(1, 0), b"b" * size)
    finally:
        share.close()

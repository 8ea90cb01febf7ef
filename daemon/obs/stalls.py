"""The stall detector: reads outstanding longer than `--stall-seconds`, and what they wait for.

Users of other FUSE caches report GPUs idle for minutes while the mount's log
shows nothing: a read hangs on a silent peer or a stuck store and nobody can
tell. Here every read in progress is visible to the main process:

* `RequestSlots` (hot path, any process): a read writes "started at, dataset
  and file" into a slot of an anonymous shared mmap made before the fork when
  it begins, the reader notes which source it is trying (local copy, peer
  NAME, store) as it tries it, and the start is cleared when the read is done:
  a handful of 8-byte stores, no lock, no system call, no allocation. Worker
  processes serve one request at a time, so each owns one slot (its
  dlfsd.base.slots.ProcessSlot).
* `StallWatch` (main process, once a second from the status task): scans the
  slots, counts each read found outstanding past the threshold once, logs it
  once (WARNING, naming the file and the source), logs when it is done, and
  reports the ones outstanding now for `dlfs status` and `.dlfs/metrics`.

Times are `time.perf_counter_ns()`, which on Linux is CLOCK_MONOTONIC: the same
clock in every process, and the read path already takes it.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlfsd.base.slots import ProcessSlot

log = logging.getLogger(__name__)

# What a read waits for (the low byte of its WAITING word; a peer's node index above it).
WAIT_DAEMON = 0  # not at a source yet (or between sources): the daemon itself
WAIT_LOCAL = 1  # this node's staged copy (NVMe)
WAIT_PEER = 2  # another node's daemon: node index << 8
WAIT_STORE = 3  # the store (parallel file system)
WAIT_NAMES = ("daemon", "local", "peer", "store")

# One slot = four int64 words.
STARTED, TARGET, WAITING, PID = range(4)
WORDS = 4
ROW_BITS = 40  # TARGET = dataset << ROW_BITS | row
ROW_MASK = (1 << ROW_BITS) - 1


class NullRequests:
    """No stall detector (`--no-stats`, `--stall-seconds 0`): every call does nothing."""

    enabled = False
    count = 0

    def begin(self, ds: int, row: int, started: int) -> None:
        pass

    def waiting(self, what: int, node: int = 0) -> None:
        pass

    def end(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_REQUESTS = NullRequests()


class RequestSlots:
    """The reads in progress of all the daemon's processes, one shared slot each
    (a worker process serves one request at a time: the slot is the process's own)."""

    enabled = True

    def __init__(self, count: int) -> None:
        self.count = count
        self._mm = mmap.mmap(-1, count * WORDS * 8)  # anonymous + shared: workers see it
        self._words = memoryview(self._mm).cast("q")
        self._slot = self._words[:WORDS]  # this process's slot (a view: no index arithmetic)

    @classmethod
    def for_processes(cls, slot: ProcessSlot) -> RequestSlots:
        """One slot per daemon process (main + workers), claimed at fork."""
        slots = cls(slot.count)
        slot.on_change(slots._use_slot)
        slots._use_slot(slot.index)
        return slots

    def _use_slot(self, index: int) -> None:
        if self._mm.closed:  # a fork long after this mount's namespace closed (tests)
            return
        self._slot = self._words[index * WORDS : (index + 1) * WORDS]
        self._slot[PID] = os.getpid()

    # -- the hot path (one request at a time in this process) ----------------------------
    def begin(self, ds: int, row: int, started: int) -> None:
        """A read of file `row` of dataset `ds` began at `started` (perf_counter_ns)."""
        slot = self._slot
        slot[TARGET] = ds << ROW_BITS | row
        slot[WAITING] = WAIT_DAEMON
        slot[STARTED] = started  # last: a nonzero start says the other words are this read's

    def waiting(self, what: int, node: int = 0) -> None:
        """The read now tries `what` (WAIT_*; `node`: the peer's index)."""
        self._slot[WAITING] = what | node << 8

    def end(self) -> None:
        self._slot[STARTED] = 0

    # -- the main process's view ----------------------------------------------------------
    def outstanding(self) -> list[tuple[int, int, int, int, int]]:
        """(slot, started, target, waiting, pid) of every read in progress now.

        A slot's words are read, then its start again: if the start changed
        meanwhile the read ended (and maybe another began) and the slot is left
        for the next scan rather than reported with another read's words.
        """
        words, found = self._words, []
        for slot in range(self.count):
            at = slot * WORDS
            started = words[at]
            if not started:
                continue
            target, waiting, pid = words[at + TARGET], words[at + WAITING], words[at + PID]
            if words[at] == started:
                found.append((slot, started, target, waiting, pid))
        return found

    def forget(self, slot: int) -> None:
        """Main process: clear the slot of a process that died in the middle of a read
        (the kernel hands its request to another worker; nobody else clears it)."""
        self._words[slot * WORDS] = 0

    def close(self) -> None:
        self._slot.release()
        self._words.release()
        self._mm.close()


@dataclass
class Stall:
    """A read outstanding past the threshold, as `dlfs status` shows it."""

    path: str  # dataset/relative path
    waiting: str  # "peer n2", "store", "local", "daemon"
    seconds: float
    pid: int  # the daemon process serving it

    def as_dict(self) -> dict:
        return {"path": self.path, "waiting": self.waiting,
                "seconds": round(self.seconds, 1), "pid": self.pid}


class StallWatch:
    """Main process: finds stalled reads in the slots; counts and logs each one once."""

    def __init__(self, requests: RequestSlots | NullRequests, threshold: float,
                 path_of: Callable[[int, int], str],
                 peer_name: Callable[[int], str] = str) -> None:
        self.requests = requests
        self.threshold_ns = int(threshold * 1e9)
        self.threshold = threshold
        self._path_of = path_of
        self._peer_name = peer_name
        self._logged: dict[int, tuple[int, str]] = {}  # slot -> (started, path) of its stall
        self.total = dict.fromkeys(WAIT_NAMES, 0)  # stalls found, by what they waited for

    def scan(self, now: int | None = None) -> tuple[list[Stall], float]:
        """(reads stalled now, age in seconds of the oldest read in progress, 0 if none)."""
        if not self.requests.enabled:
            return [], 0.0
        now = time.perf_counter_ns() if now is None else now
        stalled, oldest, seen = [], 0, set()
        for slot, started, target, waiting, pid in self.requests.outstanding():
            age = now - started
            if age >= self.threshold_ns and not _alive(pid):
                self.requests.forget(slot)
                continue
            oldest = max(oldest, age)
            if age < self.threshold_ns:
                continue
            seen.add(slot)
            stall = self._stall(target, waiting, age, pid)
            stalled.append(stall)
            if self._logged.get(slot, (0, ""))[0] != started:
                self._finished(slot, now)
                self._found(slot, started, stall, waiting & 0xFF)
        for slot in [s for s in self._logged if s not in seen]:
            self._finished(slot, now)
        return stalled, oldest / 1e9

    def _stall(self, target: int, waiting: int, age: int, pid: int) -> Stall:
        return Stall(self._path(target), self._what(waiting), age / 1e9, pid)

    def _path(self, target: int) -> str:
        try:
            return self._path_of(target >> ROW_BITS, target & ROW_MASK)
        except (IndexError, KeyError, ValueError):  # a torn slot: never worth a crash
            return f"dataset {target >> ROW_BITS} file {target & ROW_MASK}"

    def _what(self, waiting: int) -> str:
        kind = waiting & 0xFF
        if kind == WAIT_PEER:
            return f"peer {self._peer_name(waiting >> 8)}"
        return WAIT_NAMES[kind] if kind < len(WAIT_NAMES) else "daemon"

    def _found(self, slot: int, started: int, stall: Stall, kind: int) -> None:
        self.total[WAIT_NAMES[kind] if kind < len(WAIT_NAMES) else "daemon"] += 1
        self._logged[slot] = (started, stall.path)
        log.warning("read of %s stalled: outstanding for %.1f s (> --stall-seconds %g), "
                    "waiting for %s (daemon process %d)", stall.path, stall.seconds,
                    self.threshold, _waiting_text(stall.waiting), stall.pid)

    def _finished(self, slot: int, now: int) -> None:
        """The stall logged for `slot` is over (the read was answered, or failed) since
        the last scan: it took at most until now."""
        logged = self._logged.pop(slot, None)
        if logged is not None:
            log.info("stalled read of %s is done, after at most %.0f s", logged[1],
                     (now - logged[0]) / 1e9)

    def stalls_total(self) -> int:
        return sum(self.total.values())


def _alive(pid: int) -> bool:
    """The process serving a stalled read still exists (a worker may have died in it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's: a pid reused by now; not ours
        return False
    return True


def _waiting_text(what: str) -> str:
    """What a stalled read waits for, in words for the log."""
    return {"daemon": "the daemon (not at a source yet)", "local": "this node's staged copy",
            "store": "the store"}.get(what, what)

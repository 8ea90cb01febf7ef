"""Trace: every operation (time, pid, uid, op, file, offset, size, latency, source)
into a bounded ring in shared memory. Off by default; when off, the cost per
operation is the one test of `on` (a byte in shared memory).

Layout of the one anonymous shared mmap (made before the workers fork):

* a header: the on/off byte, start/stop times, one write counter per process;
* per process, a table of open handles (ino, pid, uid), so a read, which
  pyfuse3 hands over without the caller's pid and uid, can name its opener;
* per process, a ring of fixed-size records (RECORD / RECORD_DTYPE: a numpy
  structured array over the same bytes). Each process writes only its own
  ring (no lock, nothing lost between processes); the capacity is split
  evenly over the processes that serve requests (not the main one when there
  are workers). On overflow a process overwrites its oldest
  records; `dump()` reports how many were dropped.

Handles: without tracing, a file handle is the inode (stateless). While
tracing, `open` returns TRACED_FH | slot << 32 | inode: the inode keeps the
handle self-sufficient (data never depends on the table), the slot names the
opener. A slot is reused after HANDLE_SLOTS further opens in the same process;
a handle that old whose slot now holds another file reports pid/uid -1, one
that the same file reopened since reports that later opener.
"""

from __future__ import annotations

import mmap
import struct
import time
from dataclasses import dataclass

import numpy as np

from dlfsd.base.slots import ProcessSlot

OP_NAMES = ("lookup", "getattr", "open", "read", "release", "write")
OP_LOOKUP, OP_GETATTR, OP_OPEN, OP_READ, OP_RELEASE, OP_WRITE = range(len(OP_NAMES))
#: A write into the checkpoint subtree: dataset CKPT_DATASET, row = the file's inode
#: number in the node cache (dlfsd.ckpt).
CKPT_DATASET = -2
TRACE_FORMAT_VERSION = 1
DEFAULT_CAPACITY = 1 << 20

# time_ns (wall clock at the start of the operation), row, offset, size, latency_ns, pid,
# uid, dataset, op, sources (bit mask of SOURCE_* used)
RECORD = struct.Struct("<qqqqqiihBB")
RECORD_DTYPE = np.dtype([
    ("time_ns", "<i8"), ("row", "<i8"), ("offset", "<i8"), ("size", "<i8"),
    ("latency_ns", "<i8"), ("pid", "<i4"), ("uid", "<i4"), ("dataset", "<i2"),
    ("op", "u1"), ("sources", "u1")])
assert RECORD.size == RECORD_DTYPE.itemsize

TRACED_FH = 1 << 61  # handles at or above this carry an open-table slot (see module doc)
_INODE_BITS = 32
_INODE_MASK = (1 << _INODE_BITS) - 1
_SLOT_MASK = (1 << 29) - 1
HANDLE_SLOTS = 1 << 16  # open-table entries per process
_HANDLE = struct.Struct("<qii")  # ino, pid, uid
_HEADER = 4096  # on byte at 0, started_ns at 8, stopped_ns at 16, write counters from 64


@dataclass
class TraceDump:
    """A stopped (or running) trace: records sorted by time, plus bookkeeping."""

    records: np.ndarray  # RECORD_DTYPE
    dropped: int
    capacity: int
    running: bool
    started_ns: int
    stopped_ns: int


class Trace:
    """The bounded shared-memory trace of one mount."""

    def __init__(self, capacity: int, slot: ProcessSlot, recorders: int | None = None) -> None:
        """`recorders`: how many of the slot's processes serve requests (default all).
        The capacity is split over those only: with worker processes the main one
        serves none, and its ring, never written, costs no memory."""
        self.slot = slot
        recorders = min(slot.count, recorders or slot.count)
        self.per_process = max(1, capacity // recorders)
        self.capacity = self.per_process * recorders  # records kept, as reported
        self._ring_records = self.per_process * slot.count
        self._handles_at = _HEADER
        self._rings_at = _HEADER + slot.count * HANDLE_SLOTS * _HANDLE.size
        size = self._rings_at + self._ring_records * RECORD.size
        self._mm = mmap.mmap(-1, size)  # pages are only backed once written
        self._counters = memoryview(self._mm)[64 : 64 + 8 * slot.count].cast("q")
        self._next_handle = 0
        self._use_slot(slot.index)
        slot.on_change(self._use_slot)

    def _use_slot(self, index: int) -> None:
        self._index = index
        self._ring = self._rings_at + index * self.per_process * RECORD.size
        self._handle_slot0 = index * HANDLE_SLOTS
        self._next_handle = 0

    def close(self) -> None:
        self._counters.release()
        self._mm.close()

    # -- control --------------------------------------------------------------------
    @property
    def on(self) -> bool:
        return self._mm[0] == 1

    @property
    def flag(self) -> mmap.mmap:
        """Byte 0 is 1 while tracing: `if trace.flag[0]:` is the cheapest test there is."""
        return self._mm

    def start(self) -> None:
        """Empty the rings and start recording."""
        if self.on:
            return
        for i in range(self.slot.count):
            self._counters[i] = 0
        struct.pack_into("<qq", self._mm, 8, time.time_ns(), 0)
        self._mm[0] = 1

    def stop(self) -> None:
        if self.on:
            self._mm[0] = 0
            struct.pack_into("<q", self._mm, 16, time.time_ns())

    # -- the hot path (callers test `on` first) -----------------------------------------
    def record(self, op: int, ds: int, row: int, offset: int, size: int, latency_ns: int,
               pid: int, uid: int, sources: int = 0) -> None:
        n = self._counters[self._index]
        RECORD.pack_into(self._mm, self._ring + (n % self.per_process) * RECORD.size,
                         time.time_ns() - latency_ns, row, offset, size, latency_ns, pid, uid,
                         ds, op, sources)
        self._counters[self._index] = n + 1

    def open_handle(self, ino: int, pid: int, uid: int) -> int:
        """A file handle for `ino` that remembers its opener (see module doc)."""
        if ino > _INODE_MASK:
            return ino  # beyond the encodable range: stateless, reads show pid -1
        n = self._next_handle
        self._next_handle = n + 1
        slot = self._handle_slot0 + n % HANDLE_SLOTS
        _HANDLE.pack_into(self._mm, self._handles_at + slot * _HANDLE.size, ino, pid, uid)
        return TRACED_FH | slot << _INODE_BITS | ino

    def opener(self, fh: int) -> tuple[int, int]:
        """(pid, uid) of whoever opened handle `fh`; (-1, -1) if unknown."""
        if fh < TRACED_FH:
            return -1, -1
        slot = (fh >> _INODE_BITS) & _SLOT_MASK
        ino, pid, uid = _HANDLE.unpack_from(self._mm, self._handles_at + slot * _HANDLE.size)
        return (pid, uid) if ino == fh & _INODE_MASK else (-1, -1)

    # -- reading ---------------------------------------------------------------------------
    def dump(self) -> TraceDump:
        """All kept records of all processes, oldest first."""
        rings = np.frombuffer(self._mm, RECORD_DTYPE, self._ring_records, self._rings_at)
        parts, dropped = [], 0
        for i in range(self.slot.count):
            n = self._counters[i]
            ring = rings[i * self.per_process : (i + 1) * self.per_process]
            if n <= self.per_process:
                parts.append(ring[:n].copy())
            else:
                cut = n % self.per_process
                parts.append(np.concatenate([ring[cut:], ring[:cut]]))
                dropped += n - self.per_process
        records = np.concatenate(parts) if parts else np.empty(0, RECORD_DTYPE)
        records = records[np.argsort(records["time_ns"], kind="stable")]
        started, stopped = struct.unpack_from("<qq", self._mm, 8)
        return TraceDump(records, dropped, self.capacity, self.on, started, stopped)


def handle_inode(fh: int) -> int:
    """The inode of a traced handle (see module doc)."""
    return fh & _INODE_MASK

"""OpenFiles: which checkpoint files are open now, and through which FUSE passthrough
backing id, shared by every process serving the checkpoint connection.

Every open of a checkpoint file is answered by the daemon (its own connection), so
the open count per inode is known: the eviction of drained files (dlfsd.ckpt.drain)
asks `is_open` under the same lock and leaves open files alone, so no reader of a
local copy ever sees it emptied under it.

With passthrough (Linux >= 6.9, root) the kernel reads and writes an open
checkpoint file's local copy itself. It is told which file by a backing id that
the daemon registers on the connection (FUSE_DEV_IOC_BACKING_OPEN) and names in
its answer to OPEN. The kernel allows one backing file per FUSE inode at a time:
every open of a file that is already open must name the same id. Opens of one file
reach any worker process, so the ids live here, in shared memory made before the
fork: per inode its id (0: served by the daemon) and how many opens use it. The
last RELEASE closes the id.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np

from dlfsd.ckpt.nodelock import NodeLock

SLOTS = 16384  # checkpoint files open at once; beyond, opens are served, not counted
_SLOT = np.dtype([("ino", "<u8"), ("id", "<i4"), ("opens", "<u4")])


class OpenFiles:
    """Per open inode: its backing id (0: none) and its open count (one table per mount)."""

    def __init__(self, lock_path: str, slots: int = SLOTS) -> None:
        self._map = mmap.mmap(-1, slots * _SLOT.itemsize)  # MAP_SHARED: one table for all
        self._slots = np.frombuffer(self._map, dtype=_SLOT)
        self._lock = NodeLock(lock_path)

    def locked(self) -> NodeLock:
        """Held around every change of the table (and eviction's check), by any process
        or thread of the daemon."""
        return self._lock

    def _find(self, ino: int) -> int:
        hits = np.flatnonzero(self._slots["ino"] == ino)
        return int(hits[0]) if len(hits) else -1

    def acquire(self, ino: int, register: Callable[[], int]) -> int:
        """One more open of `ino` (call under `locked`); returns its backing id: the one
        in use, else `register()`'s new one (0: served by the daemon); -1 if the table
        is full (then the open is not counted)."""
        at = self._find(ino)
        if at >= 0:
            self._slots["opens"][at] += 1
            return int(self._slots["id"][at])
        free = self._find(0)
        if free < 0:
            return -1
        backing_id = register()
        self._slots[free] = (ino, backing_id, 1)
        return backing_id

    def release(self, ino: int, unregister: Callable[[int], None]) -> None:
        """One open of `ino` ended (call under `locked`); the last one unregisters its
        backing id, if it has one."""
        at = self._find(ino)
        if at < 0:
            return
        left = int(self._slots["opens"][at]) - 1
        if left > 0:
            self._slots["opens"][at] = left
            return
        backing_id = int(self._slots["id"][at])
        self._slots[at] = (0, 0, 0)
        if backing_id > 0:
            unregister(backing_id)

    def is_open(self, ino: int) -> bool:
        """`ino` is open now (call under `locked` to act on it)."""
        return self._find(ino) >= 0

    def passthrough(self, ino: int) -> bool:
        """`ino` is open through passthrough now (its writes never reach the daemon)."""
        at = self._find(ino)
        return at >= 0 and int(self._slots["id"][at]) > 0

    def counts(self) -> tuple[int, int]:
        """(files open, of them through passthrough) now, for status."""
        inos = self._slots["ino"]
        return (int(np.count_nonzero(inos)),
                int(np.count_nonzero((inos != 0) & (self._slots["id"] > 0))))

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

The table also says how many of those opens may write. Through passthrough the daemon
never sees a WRITE, so this count is what tells it that a file is being written: such
a file is not drained before it is idle, and the union with the store
(dlfsd.ckpt.union) never replaces it by another node's newer copy (the writer's
descriptor would keep writing an unlinked inode).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np

from dlfsd.ckpt.nodelock import NodeLock

SLOTS = 16384  # checkpoint files open at once; beyond, opens are served, not counted
_SLOT = np.dtype([("ino", "<u8"), ("id", "<i4"), ("opens", "<u4"), ("writers", "<u4"),
                  ("_pad", "<u4")])


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

    def acquire(self, ino: int, register: Callable[[], int], writing: bool = False) -> int:
        """One more open of `ino` (`writing`: one that may write; call under `locked`);
        returns its backing id: the one in use, else `register()`'s new one (0: served
        by the daemon); -1 if the table is full (then the open is not counted)."""
        at = self._find(ino)
        if at >= 0:
            self._slots["opens"][at] += 1
            self._slots["writers"][at] += writing
            return int(self._slots["id"][at])
        free = self._find(0)
        if free < 0:
            return -1
        backing_id = register()
        self._slots[free] = (ino, backing_id, 1, int(writing), 0)
        return backing_id

    def release(self, ino: int, unregister: Callable[[int], None],
                writing: bool = False) -> bool:
        """One open of `ino` ended (call under `locked`; `writing` as at its acquire);
        the last one unregisters its backing id, if it has one. Returns whether it was
        the last open of `ino` (True too for an open the table never counted)."""
        at = self._find(ino)
        if at < 0:
            return True
        left = int(self._slots["opens"][at]) - 1
        if left > 0:
            self._slots["opens"][at] = left
            if writing and self._slots["writers"][at]:
                self._slots["writers"][at] -= 1
            return False
        backing_id = int(self._slots["id"][at])
        self._slots[at] = (0, 0, 0, 0, 0)
        if backing_id > 0:
            unregister(backing_id)
        return True

    def is_open(self, ino: int) -> bool:
        """`ino` is open now (call under `locked` to act on it)."""
        return self._find(ino) >= 0

    def written(self, ino: int) -> bool:
        """`ino` is open for writing now, by any process."""
        at = self._find(ino)
        return at >= 0 and int(self._slots["writers"][at]) > 0

    def passthrough(self, ino: int) -> bool:
        """`ino` is open through passthrough now (its writes never reach the daemon)."""
        at = self._find(ino)
        return at >= 0 and int(self._slots["id"][at]) > 0

    def counts(self) -> tuple[int, int]:
        """(files open, of them through passthrough) now, for status."""
        inos = self._slots["ino"]
        return (int(np.count_nonzero(inos)),
                int(np.count_nonzero((inos != 0) & (self._slots["id"] > 0))))

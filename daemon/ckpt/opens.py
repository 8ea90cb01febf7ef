"""Opens: what an open and a close of a checkpoint file mean for the tier, decided once
for every worker process (dlfsd.fuse.ckptworker only packs the answers).

An open is counted in the shared open-files table (dlfsd.ckpt.openfiles) under its
lock, with the backing id of its local copy where the kernel may read and write it
itself (passthrough: not for an evicted file, whose bytes are the store's); a write-
open makes the file pending again (a RELEASE of an earlier open may have marked it
closed since CkptTree.open did). A close is the file's close for the drain only when
it was the last open: RELEASE is asynchronous, and a reader's may arrive after
another process opened the file for writing, which through passthrough it may still
be doing unseen. Both decisions are taken under the table's lock, which eviction
takes too.
"""

from __future__ import annotations

from collections.abc import Callable

from dlfsd.base.nodeids import CKPT_BIT
from dlfsd.ckpt.openfiles import OpenFiles
from dlfsd.ckpt.tree import CkptTree


class Opens:
    def __init__(self, tree: CkptTree, table: OpenFiles, passthrough: bool) -> None:
        """`passthrough`: the kernel granted it on this connection."""
        self.tree, self.table, self.passthrough = tree, table, passthrough

    def opened(self, node: int, writing: bool, register: Callable[[], int]) -> int:
        """Count an open of `node` (after CkptTree.open). Returns its backing id: > 0
        passed through, 0 served by the daemon, < 0 not counted (the table is full).
        `register` makes a backing id for the local copy (the adapter's ioctl)."""
        ino = node & ~CKPT_BIT
        with self.table.locked():
            local = self.passthrough and not self.tree.state.is_evicted(ino)
            backing_id = self.table.acquire(ino, register if local else (lambda: 0), writing)
            if writing:
                self.tree.state.touch(ino)
        return backing_id

    def lost(self, ino: int, writing: bool, unregister: Callable[[int], None]) -> None:
        """The opener was interrupted before the answer arrived: no RELEASE will come."""
        with self.table.locked():
            self.table.release(ino, unregister, writing)

    def released(self, node: int, counted: bool, writing: bool,
                 unregister: Callable[[int], None]) -> bool:
        """The kernel closed an open (`counted` at its open); drains the file if that was
        its last open. Returns whether the open was passed through (its writes were
        never seen by the daemon)."""
        ino = node & ~CKPT_BIT
        passed = False
        if counted:
            with self.table.locked():
                passed = self.table.passthrough(ino)
                if self.table.release(ino, unregister, writing):
                    self.tree.closed(ino, writing)
        else:
            self.tree.closed(ino, writing)
        self.tree.release(node)
        return passed

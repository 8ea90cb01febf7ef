"""PeerMarks: which peers each daemon process skips right now, where the main process sees it.

The chunk pool marks a peer down (timed out, refused) or a peer's copy of one
chunk bad (its bytes failed their checksum) in the process that saw it; those
marks live in that process's ChunkPool and nothing else could see them. So the
pool also writes each mark here: an anonymous shared mmap made before the fork,
one record per (process, node), each process writing only its own records
(dlfsd.base.slots.ProcessSlot). Marks are rare (at most one per peer per few
seconds per process), so a record is packed with `struct`; the main process
reads them all once a second for `dlfs status` and `.dlfs/metrics`.

Times are `time.monotonic()` seconds, the pool's own clock (CLOCK_MONOTONIC:
the same in every process).

`node_down` is one more shared array, one "skipped until" per node that every
process reads and writes: a peer one worker found down (a partition: a read
that ran into --peer-timeout) is skipped by the node's other processes at once,
so a reader, whose reads land on any worker, pays one timeout and not one per
worker (issue 33). `node_slow` likewise says until when the node's processes
read from a peer's other owners first because its reads were slow.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
import time
from dataclasses import dataclass

import numpy as np

from dlfsd.base.slots import ProcessSlot

# down until, bad copy until, times marked down, bad-copy marks, last bad (dataset, chunk),
# why it was last marked down (UTF-8, cut short).
_RECORD = struct.Struct("<ddqqqq120s")
_WHY_BYTES = 120
_MARKS_AT = 16  # the two counters (down marks, bad-copy marks) start here in a record


class NullPeerMarks:
    """A pool that reports nowhere (tests, pools made outside a mount)."""

    node_down = node_slow = None  # the pool keeps its own

    def down(self, node: int, until: float, why: str) -> None:
        pass

    def bad_copy(self, node: int, ds: int, chunk: int, until: float) -> None:
        pass


NO_PEER_MARKS = NullPeerMarks()


@dataclass
class PeerHealth:
    """One peer as the main process reports it: its marks summed over the processes."""

    node: int
    down_processes: int = 0  # processes that skip it now
    down_seconds_left: float = 0.0  # until the last of their marks expires
    down_why: str = ""  # the most recent reason
    down_marks: int = 0  # times marked down since mount, all processes
    bad_processes: int = 0  # processes that read some chunk of it elsewhere now
    bad_seconds_left: float = 0.0
    bad_marks: int = 0  # bad copies seen since mount, all processes
    bad_ds: int = -1  # the most recent bad copy: dataset index
    bad_chunk: int = -1  # and chunk

    @property
    def marked(self) -> bool:
        return bool(self.down_marks or self.bad_marks)


class PeerMarks:
    """Per (process, node) peer marks in shared memory."""

    def __init__(self, slot: ProcessSlot, nodes: int) -> None:
        self.processes = slot.count
        self.nodes = nodes
        self._mm = mmap.mmap(-1, max(1, slot.count * nodes * _RECORD.size))
        # Both counters of every record, to find the marked nodes at once (numpy).
        self._counts = np.ndarray((slot.count, nodes, 2), np.int64, self._mm, _MARKS_AT,
                                  (nodes * _RECORD.size, _RECORD.size, 8))
        self._row = slot.index
        slot.on_change(self._use_row)
        self._node_mm = mmap.mmap(-1, max(16, 16 * nodes))
        both = np.ndarray((2, nodes), np.float64, self._node_mm)  # see the docstring
        self.node_down, self.node_slow = both[0], both[1]

    def _use_row(self, index: int) -> None:
        self._row = index

    def _offset(self, process: int, node: int) -> int:
        return (process * self.nodes + node) * _RECORD.size

    def _record(self, process: int, node: int) -> list:
        return list(_RECORD.unpack_from(self._mm, self._offset(process, node)))

    # -- written by the pool in the process that made the mark ---------------------------
    def down(self, node: int, until: float, why: str) -> None:
        """This process skips `node` until `until` (time.monotonic) because of `why`."""
        rec = self._record(self._row, node)
        rec[0] = until
        rec[2] += 1
        rec[6] = why.encode(errors="replace")[:_WHY_BYTES]
        _RECORD.pack_into(self._mm, self._offset(self._row, node), *rec)

    def bad_copy(self, node: int, ds: int, chunk: int, until: float) -> None:
        """This process reads chunk `chunk` of dataset `ds` elsewhere than `node` until
        `until`: the copy `node` sent failed its checksum."""
        rec = self._record(self._row, node)
        rec[1] = max(rec[1], until)
        rec[3] += 1
        rec[4], rec[5] = ds, chunk
        _RECORD.pack_into(self._mm, self._offset(self._row, node), *rec)

    # -- read by the main process -------------------------------------------------------
    def report(self, now: float | None = None) -> list[PeerHealth]:
        """Every node any process ever marked, with its marks summed; unmarked ones left out."""
        now = time.monotonic() if now is None else now
        out = []
        for node in np.flatnonzero(self._counts.any(axis=(0, 2))).tolist():
            peer = PeerHealth(node)
            newest = 0.0
            for process in range(self.processes):
                rec = self._record(process, node)
                self._add(peer, rec, now)
                if rec[0] > newest:  # the reason of the latest mark (all last as long)
                    newest = rec[0]
                    peer.down_why = rec[6].rstrip(b"\0").decode(errors="replace")
            out.append(peer)
        return out

    @staticmethod
    def _add(peer: PeerHealth, rec: list, now: float) -> None:
        down_until, bad_until, down_marks, bad_marks, bad_ds, bad_chunk, _ = rec
        peer.down_marks += down_marks
        peer.bad_marks += bad_marks
        if down_until > now:
            peer.down_processes += 1
            peer.down_seconds_left = max(peer.down_seconds_left, down_until - now)
        if bad_until > now:
            peer.bad_processes += 1
            if bad_until - now >= peer.bad_seconds_left:
                peer.bad_seconds_left = bad_until - now
                peer.bad_ds, peer.bad_chunk = bad_ds, bad_chunk
        elif bad_marks and peer.bad_chunk < 0:
            peer.bad_ds, peer.bad_chunk = bad_ds, bad_chunk

    def close(self) -> None:
        self._counts = None
        self._mm.close()
        self.node_down = self.node_slow = None
        with contextlib.suppress(BufferError):  # a pool holds the array: it goes with that
            self._node_mm.close()

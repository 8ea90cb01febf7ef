"""SlowPeers: which peers' reads are slow, by two rules, in one daemon process.

ChunkPool.fetch times every read from a peer and hands the time here; a peer
found slow is asked last, after a chunk's other live owners, for SLOW_SECONDS by
every process of the node (ChunkPool marks it; `dlfs status` says "peer n3 is
slow ..., asked last" and the reason given here). Slow links come in two shapes,
so there are two rules:

* The share rule, for a peer slow on most reads (a 10 Mbit/s link, heavy loss):
  a read slower than SLOW_FLOOR + bytes / SLOW_RATE is slow, and once a moving
  average of the slow share of its reads (weight SLOW_WEIGHT) passes SLOW_SHARE
  (three slow reads in a row do it) the peer is slow.
* The time rule, for a peer that stalls rarely but long: one that loses single
  packets (1%, docs/SCALE.md) makes ~2% of its reads wait a TCP retransmission
  timeout of ~210 ms while the rest take ~0.6 ms, so its mean read costs ~5 ms
  against 0.6 ms from a healthy owner, yet its share of slow reads stays near 2%.
  Per peer, this process sums the seconds and bytes of its reads and counts its
  stalls (reads STALL_FLOOR slower than their bytes take at STALL_RATE) in
  windows of TIME_WINDOW reads: the measure is the current window and the one
  before, the peer's last TIME_WINDOW to 2 * TIME_WINDOW reads. At each stall the
  peer is slow if that measure holds TIME_STALLS stalls, and its time per byte is
  TIME_RATIO times what the other peers' reads took (their windows together, at
  least TIME_OTHERS reads: "while a faster source exists"), and its mean read
  costs TIME_EXCESS more than the same bytes from them. With no other peer
  measured it is never slow (nothing is known to be faster; the store is not).

Each process measures its own reads (a worker's reads are its own; the mark is
node-wide, so the first process that finds a peer slow speaks for the node). A
peer found slow is measured afresh when it is asked again, so a slow peer is
not the yardstick of another while it is asked last, nor found slow again at
once from old reads. The look-ahead's fetch threads share their process's
sums: an update lost between two threads is a read not counted, nothing more.

The read path is hot (~150 us per file all told): a read costs two method
calls (ChunkPool._timed, then here), four additions, a division, three
comparisons and a dict lookup, no allocation: ~120 ns more than the share
rule's inline check alone (79 -> 197 ns a read, timeit on the 2-core VM); the
rules' own work is done on slow reads only.
"""

from __future__ import annotations

SLOW_FLOOR, SLOW_RATE = 0.01, 8e6  # s, bytes/s: a 110 KiB read over 24 ms is slow
SLOW_SHARE, SLOW_WEIGHT = 0.3, 0.125  # moving average of slow reads that marks a peer slow
# A stall: a read 100 ms slower than its bytes take at 100 MB/s. Far above a healthy read
# (110 KiB over 10 Gbit/s: 0.6 ms; a whole 4 MiB extent: 3.4 ms, 42 ms at 100 MB/s),
# below a TCP retransmission timeout (200 ms at least on Linux), so a read that waits
# for one counts, whatever its size.
STALL_FLOOR, STALL_RATE = 0.1, 1e8
# Windows of 64 reads, so the rule sees a peer's last 64 to 128. Three stalls in them:
# one or two hiccups of a healthy peer (a GC pause, a descheduled worker on a loaded
# machine) never mark it. Simulated (reads stalling at random, a check at every stall):
# a peer stalling on 2% of its reads is marked after a median of 157 of its reads (90%
# within 430), at 3% 103 (236), at 1% 491 (1514); a healthy one with a 100 ms hiccup
# in every 1000 reads is marked within 10,000 reads in 2.5% of runs, and then only if
# the other peers read 3 times faster meanwhile.
TIME_WINDOW, TIME_STALLS = 64, 3
# The stalls must matter against what the others deliver: three 200 ms stalls in 128
# reads of 4 MiB extents (3.4 ms each) make them cost 2.4 times as much: not worth
# moving the load to the other owners; in 128 reads of 110 KiB (0.6 ms) 8.8 times. And an
# absolute floor: a peer at 1 ms a read against 0.3 ms is slower, but not slow (three
# stalls in 128 reads alone add 2.3 ms a read; the floor holds whatever the window).
TIME_RATIO, TIME_EXCESS = 3.0, 0.002
TIME_OTHERS = 32  # reads of the other peers, at least, to compare with


class PeerReads:
    """One peer's reads in this process: the window being filled and the one before."""

    __slots__ = ("nbytes", "old_nbytes", "old_reads", "old_seconds", "old_stalls", "reads",
                 "seconds", "stalls")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.seconds = self.old_seconds = 0.0
        self.nbytes = self.reads = self.stalls = 0
        self.old_nbytes = self.old_reads = self.old_stalls = 0

    def roll(self) -> None:
        """The window is full: it becomes the one before, a new one starts."""
        self.old_seconds, self.old_nbytes = self.seconds, self.nbytes
        self.old_reads, self.old_stalls = self.reads, self.stalls
        self.seconds = 0.0
        self.nbytes = self.reads = self.stalls = 0


class SlowPeers:
    """The two rules over this process's reads from the peers `names` (by node index)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._share: dict[int, float] = {}  # node -> moving average of slow reads (0..1)
        self._reads = [PeerReads() for _ in names]

    def forget(self) -> None:
        """Forget every measure (a forked worker: the parent's reads are not its own)."""
        self._share = {}
        for reads in self._reads:
            reads.clear()

    def timed(self, node: int, took: float, length: int) -> str | None:
        """A read of `length` bytes from `node` took `took` s. Returns why the peer is slow
        if it is now (its measures start afresh), else None."""
        reads = self._reads[node]
        reads.seconds += took
        reads.nbytes += length
        reads.reads += 1
        if reads.reads >= TIME_WINDOW:
            reads.roll()
        if took > SLOW_FLOOR + length / SLOW_RATE or took > STALL_FLOOR or node in self._share:
            return self._slow_read(node, took, length, reads)
        return None

    def _slow_read(self, node: int, took: float, length: int, reads: PeerReads) -> str | None:
        """A slow read, one over STALL_FLOOR, or a read of a peer whose share of slow reads
        is still counted."""
        why = self._share_rule(node, took, length)
        if why is None and took > STALL_FLOOR + length / STALL_RATE:
            reads.stalls += 1
            why = self._time_rule(node, reads)
        if why is not None:
            self._share.pop(node, None)
            reads.clear()
        return why

    def _share_rule(self, node: int, took: float, length: int) -> str | None:
        """Keep the moving average of the peer's slow reads (only once one was slow)."""
        slow = took > SLOW_FLOOR + length / SLOW_RATE
        share = self._share.get(node, 0.0) * (1.0 - SLOW_WEIGHT) + SLOW_WEIGHT * slow
        if share < 0.01:
            self._share.pop(node, None)
            return None
        self._share[node] = share
        if share < SLOW_SHARE:
            return None
        return (f"slow ({length >> 10} KiB in {took * 1e3:.0f} ms, {length / took / 1e6:.1f} "
                f"MB/s; {share:.0%} of its recent reads slow)")

    def _time_rule(self, node: int, reads: PeerReads) -> str | None:
        """At a stall: whether the peer's last reads cost so much more than the other peers'
        that it is slow (see the module docstring)."""
        count = reads.reads + reads.old_reads
        stalls = reads.stalls + reads.old_stalls
        if stalls < TIME_STALLS or count < TIME_WINDOW:
            return None
        seconds = reads.seconds + reads.old_seconds
        nbytes = reads.nbytes + reads.old_nbytes
        other_seconds, other_bytes, other_reads, others = 0.0, 0, 0, []
        for other, theirs in enumerate(self._reads):
            if other != node and theirs.reads + theirs.old_reads:
                other_seconds += theirs.seconds + theirs.old_seconds
                other_bytes += theirs.nbytes + theirs.old_nbytes
                other_reads += theirs.reads + theirs.old_reads
                others.append(other)
        if other_reads < TIME_OTHERS or not nbytes or not other_bytes:
            return None
        mean = seconds / count
        theirs_mean = other_seconds / other_bytes * (nbytes / count)  # the same bytes from them
        if seconds / nbytes < TIME_RATIO * other_seconds / other_bytes \
                or mean - theirs_mean < TIME_EXCESS:
            return None
        them = self.names[others[0]] if len(others) == 1 else f"{len(others)} other peers"
        return (f"slow (mean {mean * 1e3:.1f} ms a read over its last {count} reads, "
                f"{stalls} over {STALL_FLOOR * 1e3:.0f} ms; {them} {theirs_mean * 1e3:.1f} ms)")

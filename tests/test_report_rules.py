"""`dlfs report` and the daemon's counters call the same reads random.

By default the kernel opens files without the daemon (FUSE no_open), so a trace
holds reads but no opens: a file read again from its start is sequential for
the counters (docs/STATS.md) and must be for the report too.
"""

from __future__ import annotations

import numpy as np

from dlfs.obs.report import random_read_count
from dlfs.obs.traceclient import Trace
from dlfs.store.directory import SourceEntry, build_directory
from dlfsd.base.slots import ProcessSlot
from dlfsd.obs.stats import Stats

# (file, offset, size): three whole reads of a, a skip in b, then b read on from there.
READS = [(1, 0, 100), (1, 0, 100), (1, 0, 100), (2, 0, 50), (2, 500, 50), (2, 550, 50)]


def _trace(reads: list[tuple[int, int, int]]) -> Trace:
    dtype = np.dtype([("time_ns", "i8"), ("pid", "i4"), ("uid", "i4"), ("op", "i2"),
                      ("path", "i4"), ("offset", "i8"), ("size", "i8"), ("latency_ns", "i8"),
                      ("source", "U16")])
    records = np.array([(i, 1, 0, 0, f, off, size, 1000, "store")
                        for i, (f, off, size) in enumerate(reads)], dtype)
    return Trace(records, ["read"], ["", "ds/a", "ds/b"])


def _counted_random(reads: list[tuple[int, int, int]]) -> int:
    entries = [SourceEntry(b"", 0o40755, 0, 0), SourceEntry(b"a", 0o100644, 100, 0),
               SourceEntry(b"b", 0o100644, 600, 0)]
    d = build_directory(entries, 1 << 20)
    rows = {1: d.resolve(b"a"), 2: d.resolve(b"b")}
    stats = Stats(["ds"], [d], ProcessSlot(1))
    try:
        for f, off, size in reads:
            stats.record_read(0, rows[f], off, size, 1000)
        return stats.snapshot()["datasets"]["ds"]["random_reads"]
    finally:
        stats.close()


def test_report_and_counters_agree_on_random_reads_without_opens():
    counted = _counted_random(READS)
    assert counted == 1  # only the jump to 500
    assert random_read_count(_trace(READS)) == counted

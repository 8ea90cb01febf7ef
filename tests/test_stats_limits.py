"""Stats at scale: per-file counters at their 32-bit limit (a read must never fail
because it was counted), and the top files of many without a full sort.

A long-lived mount of a one-file dataset (LMDB, HDF5) doing small random reads
reaches 2**32 reads of that file in about a day at 50k reads/s.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dlfs.store.directory import SourceEntry, build_directory
from dlfsd.base.slots import ProcessSlot
from dlfsd.obs.stats import COUNT_MAX, Stats, top_rows


def test_a_files_counters_stop_at_their_limit_instead_of_failing_the_read():
    entries = [SourceEntry(b"", 0o40755, 0, 0), SourceEntry(b"db.lmdb", 0o100644, 4096, 0)]
    d = build_directory(entries, 1 << 20)
    row = d.resolve(b"db.lmdb")
    stats = Stats(["ds"], [d], ProcessSlot(1))
    try:
        stats.record_open(0, row)
        stats.record_read(0, row, 0, 100, 1000)
        f = stats._file_base[0] + row  # jump to the limit: 2**32 real calls take hours
        stats._fopens[f] = COUNT_MAX - 1
        stats._freads[f] = COUNT_MAX - 1
        for offset in (100, 200, 300):
            stats.record_open(0, row)
            stats.record_read(0, row, offset, 100, 1000)
        (top,) = stats.snapshot()["datasets"]["ds"]["top_files"]
        assert top["opens"] == COUNT_MAX and top["reads"] == COUNT_MAX
        assert top["bytes"] == 400  # the 64-bit byte count goes on
    finally:
        stats.close()


@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 4)), max_size=80,
                unique_by=lambda t: t[0]),
       st.integers(1, 30))
def test_top_files_are_those_a_full_stable_sort_gives(files, count):
    """The partial selection behind `top_files` equals sorting everything (ties by row)."""
    files.sort()
    rows = np.array([r for r, _ in files], dtype=np.int64)
    nbytes = np.array([b for _, b in files], dtype=np.int64)
    expected = rows[np.argsort(-nbytes, kind="stable")[:count]]
    assert top_rows(rows, nbytes, count).tolist() == expected.tolist()

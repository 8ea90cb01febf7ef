"""Snapshots of counters that other processes keep writing (the daemon's status writer
and `.dlfs/stats.json` run while workers serve reads)."""

from __future__ import annotations

import os
import signal
import time

from dlfs.store.directory import SourceEntry, build_directory
from dlfsd.base.slots import ProcessSlot
from dlfsd.obs.stats import SOURCE_PEER, Stats


def _directory(files: int):
    entries = [SourceEntry(b"", 0o40755, 0, 0)] + [
        SourceEntry(f"f{i}".encode(), 0o100644, 10, 0) for i in range(files)]
    return build_directory(entries, 1 << 20)


def test_snapshot_while_another_process_writes_never_fails():
    d = _directory(5000)
    stats = Stats(["ds"], [d], ProcessSlot(2))
    pid = os.fork()
    if pid == 0:  # a worker recording opens and reads as fast as it can
        try:
            row = 0
            while True:
                row = row % 5000 + 1
                stats.record_open(0, row)
                stats.record_read(0, row, 0, 10, 1000)
                stats.record_source(0, SOURCE_PEER, 10, 1000)
        finally:
            os._exit(0)
    try:
        def counts() -> tuple:
            """Counters the worker only ever adds to, from a snapshot and a status read."""
            snap = stats.snapshot()
            ds = snap["datasets"]["ds"]
            peer = stats.sources()["ds"]["peer"]
            return (snap, (ds["opens"], ds["reads"], ds["bytes"], ds["files_touched"],
                           ds["sources"]["peer"]["reads"], peer["reads"], peer["bytes"],
                           peer["latency_ns_sum"]))

        deadline = time.monotonic() + 30
        snap, first = counts()
        while first[1] == 0:  # the worker has started recording
            assert time.monotonic() < deadline, "the worker recorded nothing"
            snap, first = counts()
        previous, snapshots = first, 0
        while snapshots < 200 or previous[1] == first[1]:
            snap, now = counts()
            # Torn or half-summed reads would show as a counter going back.
            assert all(b >= a for a, b in zip(previous, now, strict=True)), (previous, now)
            previous, snapshots = now, snapshots + 1
            assert time.monotonic() < deadline, "the worker's counts stood still"
        assert snap["datasets"]["ds"]["files_touched"] > 0
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        stats.close()

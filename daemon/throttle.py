"""Store bandwidth pacing, for benchmarks that model a slow parallel file system.

A parallel file system gives each client stream a bounded bandwidth while
the aggregate scales with streams, so pacing is per read call: a read of n
bytes takes at least n / rate seconds. Off (rate 0) in production.
"""

from __future__ import annotations

import time


def pace(rate: int, nbytes: int, started: float) -> None:
    """Sleep until a read of `nbytes` begun at `started` (monotonic) took nbytes / rate."""
    if rate > 0:
        delay = started + nbytes / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)

"""Pacing: store bandwidth for benchmarks that model a slow parallel file system,
and a token bucket for events that must stay rare (reports of bad copies).

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


class TokenBucket:
    """At most `rate` events per second on average, `burst` at once: what a peer's
    reports of bad copies may cost (each side holds its own). Not thread-safe: one
    owner (a process's pool, the peer server's loop thread)."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._tokens = float(burst)
        self._stamp = time.monotonic()

    def take(self) -> bool:
        """One event now, if the budget allows it."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

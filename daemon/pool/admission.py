"""Admission: who may take one of the peer server's connection slots, decided at accept.

Why: the server has a fixed number of slots (`max_connections`) and a
connection holds one from accept until its handshake fails or times out (5 s).
Tried against a running pool, 300 idle TCP connections from one stranger
(no handshake, reconnecting every 5 s) filled all 256, so the job's own peers
were refused and fell back to the store for as long as the stranger kept on.
The node list says who the peers are, so:

- a connection from an address outside the node list ("stranger") may only
  use `stranger_slots` slots while it has not proven the job secret, and at
  most `per_source` of them per address: the other slots stay free for the
  nodes of the job (whose address may still be unlisted, e.g. a multi-homed
  node: it then competes for the stranger slots, it is never locked out);
- an address of the node list may hold at most a quarter of the slots
  unauthenticated (a node runs several worker processes, each with its own
  connection; another user's process on a job node must not fill them all);
- once a connection has proven the secret, it is a peer wherever it comes from.

Refusals are logged once per reason as they start and then summed up once a
minute (RefusalLog): a flood must not become a flood of log lines. Failed
handshakes (a wrong secret, no handshake in time, garbage before it) likewise:
the first of a cause with its detail, then at most one summary line per cause
every 10 s (HandshakeFailureLog).

Sans-I/O: the server asks and reports; tests drive it directly.
"""

from __future__ import annotations

import collections
import logging
import time

log = logging.getLogger("dlfsd.pool.peer")

FULL = "all connection slots are taken"
STRANGERS_FULL = "the slots for addresses outside the node list are taken"
SOURCE_FULL = "too many connections from this address have not authenticated yet"


def plain_ip(host: str) -> str:
    """An IPv4 address as accepted by a dual-stack IPv6 socket (::ffff:a.b.c.d) -> a.b.c.d."""
    return host[7:] if host.startswith("::ffff:") and "." in host else host


class Admission:
    """Counts unauthenticated connections per source; says which to refuse."""

    def __init__(self, trusted: frozenset[str] | None, max_connections: int,
                 stranger_slots: int = 32, per_source: int = 4, share: int = 1) -> None:
        """`share`: how many servers (processes, dlfsd.pool.peerprocs) accept for the
        node, each with an Admission of its own: each then counts a `share`-th of the
        node's unauthenticated slots (strangers', per source; at least one each), so
        that together they hold to the node's limits. `max_connections` is the node's;
        the caller passes the node's open connections to admit()."""
        # trusted None: no node list to go by (a pool of one, tests): every address
        # is treated as a node of the job.
        share = max(1, share)
        self.trusted = None if trusted is None else frozenset(plain_ip(a) for a in trusted)
        self.max_connections = max_connections
        self.stranger_slots = max(1, min(stranger_slots, max_connections) // share)
        self.per_source = max(1, per_source // share)
        self.per_trusted_source = max(self.per_source, max_connections // 4 // share)
        self._pending: collections.Counter[str] = collections.Counter()  # by address
        self._pending_strangers = 0

    def is_stranger(self, ip: str) -> bool:
        return self.trusted is not None and ip not in self.trusted

    def admit(self, ip: str, open_connections: int) -> str | None:
        """None to accept a new connection from `ip` (counted pending until it
        authenticates or closes), else why it is refused."""
        if open_connections >= self.max_connections:
            return FULL
        stranger = self.is_stranger(ip)
        if stranger and self._pending_strangers >= self.stranger_slots:
            return STRANGERS_FULL
        limit = self.per_source if stranger else self.per_trusted_source
        if self._pending[ip] >= limit:
            return SOURCE_FULL
        self._pending[ip] += 1
        self._pending_strangers += stranger
        return None

    def authenticated(self, ip: str) -> None:
        """The connection from `ip` proved the secret: no longer pending."""
        self._release(ip)

    def closed_pending(self, ip: str) -> None:
        """A connection from `ip` closed before it authenticated."""
        self._release(ip)

    def _release(self, ip: str) -> None:
        if self._pending[ip] <= 0:
            return
        self._pending[ip] -= 1
        if not self._pending[ip]:
            del self._pending[ip]
        self._pending_strangers -= self.is_stranger(ip)


class RefusalLog:
    """One warning when refusals of a kind start, then one summary per `interval`."""

    def __init__(self, interval: float = 60.0, clock=time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._since: dict[str, float] = {}  # reason -> when its current window began
        self._counts: dict[str, int] = {}  # refusals in the window, after the first
        self._sources: dict[str, set[str]] = {}

    def refused(self, ip: str, reason: str) -> None:
        if reason not in self._since:
            self._since[reason] = self._clock()
            self._counts[reason], self._sources[reason] = 0, set()
            log.warning("peer server: refused a connection from %s: %s (further refusals "
                        "are summed up every %.0f s)", ip, reason, self.interval)
            return
        self._counts[reason] += 1
        self._sources[reason].add(ip)

    def flush(self) -> None:
        """Log the sums of windows that are over (called from the server's sweep)."""
        now = self._clock()
        for reason, since in list(self._since.items()):
            if now - since < self.interval:
                continue
            count, sources = self._counts.pop(reason), self._sources.pop(reason)
            del self._since[reason]
            if count:
                log.warning("peer server: refused %d more connections from %d addresses "
                            "in %.0f s (%s); e.g. %s", count, len(sources), now - since,
                            reason, ", ".join(sorted(sources)[:3]))


class HandshakeFailureLog:
    """Failed peer handshakes, logged as rate-limited summaries per cause.

    Why: anyone who can reach the peer port can fail a handshake as fast as they can
    connect; one line each filled the log. The first failure of a cause is logged at
    once with its detail (a misconfigured node says what is wrong right away); the
    ones after it are counted and summed up when `interval` has passed since the
    last line of that cause: at most one line per cause per `interval`.
    """

    def __init__(self, interval: float = 10.0, clock=time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._since: dict[str, float] = {}  # cause -> when its last line was logged
        self._counts: dict[str, int] = {}  # failures since that line
        self._sources: dict[str, set[str]] = {}

    def failed(self, ip: str, cause: str, detail: str) -> None:
        """A handshake from `ip` failed for `cause` (a short, fixed text); `detail`
        names the connection and what happened."""
        if cause not in self._since:
            self._since[cause] = self._clock()
            self._counts[cause], self._sources[cause] = 0, set()
            log.warning("peer server: failed peer handshake: %s (further failures of this "
                        "kind are summed up every %.0f s)", detail, self.interval)
            return
        self._counts[cause] += 1
        self._sources[cause].add(ip)

    def flush(self) -> None:
        """Log the sums of causes whose interval is over (called from the server's
        sweep); a cause with none since its last line is forgotten."""
        now = self._clock()
        for cause, since in list(self._since.items()):
            if now - since < self.interval:
                continue
            count, sources = self._counts[cause], self._sources[cause]
            if not count:
                del self._since[cause], self._counts[cause], self._sources[cause]
                continue
            log.warning("peer server: %d failed peer handshakes from %d addresses in the "
                        "last %.0f s: %s (e.g. %s)", count, len(sources), now - since, cause,
                        ", ".join(sorted(sources)[:3]))
            self._since[cause], self._counts[cause], self._sources[cause] = now, 0, set()

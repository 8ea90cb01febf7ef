"""Holding stop signals across a few system calls that must not be cut in two.

Used where an interrupt in the middle would leave something behind that nothing
cleans up: between the two renames of `populate --force`, between starting
a daemon and knowing its pid in `dlfs mount` (a Ctrl-C there used to leave a
running daemon no one would stop), and while `dlfs mount` stops a daemon it
gave up on.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP for a few system calls: one that arrives meanwhile
    is acted on (by the handler it would have met) on leaving. Python runs handlers in
    the main thread only, so swapping them holds a signal whichever thread the kernel
    gives it to (a blocked mask would not, and a child started meanwhile would inherit
    it); elsewhere nothing can be held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
           for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block the stop signals (in the kernel) around a fork. The child starts with them
    blocked, so one sent to it before it has its own handlers waits for them
    (unblock_stop_signals) instead of meeting the handler it inherited, which may
    only record it for the parent (a daemon's HeldStopSignals): a worker stopped
    right after its fork used to serve on until SIGKILL. The parent's mask is
    restored on leaving; a signal meanwhile sent to the parent is then delivered."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock_stop_signals() -> None:
    """In a child forked under stop_signals_blocked, once its own handlers are in place."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

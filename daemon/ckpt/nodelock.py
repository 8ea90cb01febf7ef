"""NodeLock: one exclusive lock for every process and thread of the daemon on a node.

The checkpoint tier's workers are forked processes and its drain runs threads in the
main one; several of them change shared things (names in the tree, the open-files
table). An flock belongs to the open file, which forked processes would share, so
each process opens the lock file itself; threads of one process share that open
file, so a thread lock comes first. A process that dies holding it releases it (the
kernel drops its flock), unlike a semaphore in shared memory.

The per-process setup (its own open of the lock file, a fresh thread lock: a copy
forked from the parent may be held by a thread that does not exist here) is done
once per process under a module lock: two threads entering first at once (the
drain's threads publishing two files together) would otherwise each set up their
own, and one could flock through a descriptor the other then replaced and never
unlock it, leaving every process of the daemon waiting for the tier's lock.
"""

from __future__ import annotations

import fcntl
import os
import threading

_SETUP = threading.Lock()  # per-process setup of any NodeLock (re-made after a fork)


def _after_fork_in_child() -> None:
    global _SETUP
    _SETUP = threading.Lock()  # the parent's may have been held by another thread


os.register_at_fork(after_in_child=_after_fork_in_child)


class NodeLock:
    """`with lock:` excludes every other process and thread using the same `path`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pid = -1  # the process the two below belong to (a fork starts afresh)
        self._fd = -1
        self._thread = threading.Lock()

    def _set_up(self) -> None:
        """This process's own open of the lock file and thread lock, made once."""
        with _SETUP:
            pid = os.getpid()
            if self._pid == pid:
                return  # another thread did meanwhile
            if self._fd >= 0:  # the parent's (shared with it: its flock is the parent's)
                os.close(self._fd)
            self._thread = threading.Lock()  # (a copy could be held by a gone thread)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = pid  # last: a thread that sees it sees the two above

    def __enter__(self) -> NodeLock:
        if self._pid != os.getpid():  # first use in this process (or forked since)
            self._set_up()
        self._thread.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread.release()

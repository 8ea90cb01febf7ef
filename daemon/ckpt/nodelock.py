"""NodeLock: one exclusive lock for every process and thread of the daemon on a node.

The checkpoint tier's workers are forked processes and its drain runs threads in the
main one; several of them change shared things (names in the tree, the open-files
table). An flock belongs to the open file, which forked processes would share, so
each process opens the lock file itself; threads of one process share that open
file, so a thread lock comes first. A process that dies holding it releases it (the
kernel drops its flock), unlike a semaphore in shared memory.
"""

from __future__ import annotations

import fcntl
import os
import threading


class NodeLock:
    """`with lock:` excludes every other process and thread using the same `path`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pid = -1  # the process the two below belong to (a fork starts afresh)
        self._fd = -1
        self._thread = threading.Lock()

    def __enter__(self) -> NodeLock:
        if self._pid != os.getpid():  # forked: only the forking thread lives on here
            self._thread = threading.Lock()  # (a copy could be held by a gone thread)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = os.getpid()
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

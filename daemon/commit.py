"""LaunchCommit: a daemon that keeps its mount only once its launcher says so.

`mpirun ... dlfs mount --mpi` brings up one daemon per rank, all or none: each
rank mounts, then the ranks compare notes. A rank that is interrupted or killed
in between (Ctrl-C on mpirun, scancel, a rank that never comes up and mpirun
giving up on the job) cannot take down what it already mounted, and the daemons
run in their own sessions, so they would outlive the job with nobody to unmount
them. So such a daemon is handed the read end of a pipe whose write end only
its rank holds: the rank writes COMMIT once every rank is up. If the pipe ends
without COMMIT, the rank is gone or gave up, and the daemon unmounts itself.
The kernel closes the write end whatever way the rank ends, SIGKILL included.
"""

from __future__ import annotations

import contextlib
import errno
import os

import trio

from dlfs.cluster.mpi_launch import launch_secret_file
from dlfs.config import MountConfig
from dlfs.launch import COMMIT, COMMIT_FD_ENV


class LaunchCommit:
    """The daemon's end of the commit pipe ($DLFS_COMMIT_FD), if it was given one."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        # Forked workers and the control process have no use for it.
        os.register_at_fork(after_in_child=self._forget)

    @classmethod
    def from_env(cls) -> LaunchCommit:
        value = os.environ.pop(COMMIT_FD_ENV, None)
        return cls(int(value) if value else None)

    @property
    def pending(self) -> bool:
        return self.fd is not None

    def _forget(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    async def wait(self) -> bool:
        """Wait for the launcher's word: True on COMMIT, False if the pipe ended first."""
        if self.fd is None:
            return True
        received = b""
        try:
            while not received.endswith(b"\n"):
                await trio.lowlevel.wait_readable(self.fd)
                try:
                    data = os.read(self.fd, 64)
                except OSError as err:
                    if err.errno in (errno.EAGAIN, errno.EINTR):
                        continue
                    return False
                if not data:
                    return False
                received += data
            return received == COMMIT
        finally:
            self._forget()


def discard_launch_secret(config: MountConfig) -> None:
    """Remove the secret file `dlfs mount --mpi` wrote for this node, if this mount used
    it (its default place): the launch failed, so no `dlfs umount --mpi` will, and the
    rank that wrote it may have been killed. The daemon read it at start-up already."""
    if config.node and config.secret_file == launch_secret_file(config.node,
                                                                config.mountpoint):
        with contextlib.suppress(OSError):
            os.unlink(config.secret_file)

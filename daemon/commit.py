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

LauncherPipe is what this pipe and the readiness pipe (dlfsd.main.Readiness) share:
an end the launcher passed, held by the main process alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass

import trio

from dlfs.cluster.mpi_launch import launch_secret_file
from dlfs.launch import COMMIT, COMMIT_FD_ENV


@dataclass(frozen=True)
class LaunchSecret:
    """The job secret file this mount was given, and where it runs: what an abandoned
    launch removes (see discard)."""

    path: str | None  # --secret-file
    node: str | None  # --node
    mountpoint: str

    def discard(self) -> None:
        """Remove the secret file `dlfs mount --mpi` wrote for this node, if this mount
        used it (its default place): the launch failed, so no `dlfs umount --mpi` will,
        and the rank that wrote it may have been killed. The daemon read it at start-up
        already. A file the user named is theirs, and left alone."""
        if self.node and self.path == launch_secret_file(self.node, self.mountpoint):
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class LauncherPipe:
    """The daemon's end of a pipe its launcher passed (dlfs.launch), if it was given one:
    the main process's alone. Forked workers and the control process close theirs at
    once: they have no use for it, and one kept open would hide the main process's end
    (a launcher waiting for READY would see no end of file if the daemon died)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        os.register_at_fork(after_in_child=self.close)

    @staticmethod
    def fd_from_env(name: str) -> int | None:
        """The descriptor the launcher named in environment variable `name` (taken out
        of the environment: what the daemon starts must not inherit it)."""
        value = os.environ.pop(name, None)
        return int(value) if value else None

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class LaunchCommit(LauncherPipe):
    """The daemon's end of the commit pipe ($DLFS_COMMIT_FD), if it was given one."""

    def __init__(self, fd: int | None, secret: LaunchSecret | None = None) -> None:
        """`secret`: what to remove if the launch is abandoned (give_up)."""
        super().__init__(fd)
        self.secret = secret

    @classmethod
    def from_env(cls, secret: LaunchSecret | None = None) -> LaunchCommit:
        return cls(cls.fd_from_env(COMMIT_FD_ENV), secret)

    def give_up(self) -> None:
        """The launcher went away without committing: leave none of the launch behind
        that only it would have removed (its secret file)."""
        if self.secret is not None:
            self.secret.discard()

    @property
    def pending(self) -> bool:
        return self.fd is not None

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
            self.close()


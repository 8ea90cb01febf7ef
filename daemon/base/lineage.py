"""A forked daemon process dies with the main one (parent-death signal).

The workers and the control process are forked by the main daemon process and
hold the mount's /dev/fuse descriptor. If the main process is killed (SIGKILL,
the OOM killer), nothing sends them SIGTERM: they would serve on unsupervised
(no resend when one of them dies, no stager, no status file), and the kernel
keeps the connection up for as long as any of them holds the descriptor. So
each asks the kernel, right after the fork, for a signal when its parent dies
(prctl PR_SET_PDEATHSIG). Once the last of them has exited, the descriptor is
closed, the kernel aborts the connection and readers get ENOTCONN, never a hang.

Two catches. The signal comes when the *thread* that forked exits, not the
process: fork from the main thread (the daemon does), whose end is the
process's. And a parent that dies between fork() and prctl() sends nothing, so
the child checks afterwards that its parent is still the one that forked it.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]
_libc.prctl.restype = ctypes.c_int


def die_with_parent(parent: int, signum: int = signal.SIGTERM) -> bool:
    """In a child just forked by process `parent`: have the kernel send `signum` to this
    process when the parent (the thread that forked it) exits. Returns False if the
    parent is gone already (it died before the request was in, so no signal will come):
    the caller must then stop by itself."""
    if _libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return os.getppid() == parent


def parent_alive(parent: int) -> bool:
    """The process that forked this one is still our parent (not dead, which would have
    made init or a subreaper our parent)."""
    return os.getppid() == parent


PR_SET_NAME = 15  # <linux/prctl.h>


def name_process(name: str) -> None:
    """Name this process (its main thread) as `ps -o comm`, top and /proc/PID/comm show
    it, at most 15 bytes: forked processes keep their parent's command line, and an
    admin (or a test) must tell a peer server from a FUSE worker. Best effort."""
    buffer = ctypes.create_string_buffer(name.encode()[:15])
    _libc.prctl(PR_SET_NAME, ctypes.cast(buffer, ctypes.c_void_p).value, 0, 0, 0)

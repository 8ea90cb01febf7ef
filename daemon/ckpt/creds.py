"""Creds: the job user's file-system credentials, taken by one thread around each file
operation the checkpoint tier does on a tree that user can shape.

Why: a root daemon (the Slurm prolog mounts for a job's `--uid/--gid` user) must not
open, create, rename or remove anything with root's powers in a directory that user
owns (the checkpoint store) or fills (the local tree): a symlink or a swapped
directory would turn each call into a root read or write anywhere. With the thread's
fsuid/fsgid and supplementary groups set to the user's, the kernel checks every path
as it would for the user, and root's file capabilities (CAP_DAC_OVERRIDE, CAP_CHOWN,
CAP_FOWNER...) are dropped from the thread while its fsuid is not 0 (setfsuid(2)).
What needs root stays root: the FUSE connection, passthrough backing registration
(CAP_SYS_ADMIN is no file capability), the tier's own root-owned state.

How: setfsuid/setfsgid are per thread at the kernel level and glibc's wrappers call
them for the calling thread only (unlike setuid and setgroups, which glibc repeats in
every thread); supplementary groups are set with the raw setgroups system call, so
for this thread only, once per thread. Samba's become_user and NFS-Ganesha's
set_creds do the same. Python threads stay on their OS thread, so a `with creds:`
block runs wholly under the user's credentials.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import pwd
import threading

log = logging.getLogger("dlfsd")

# The raw setgroups(2) system call (per thread); glibc's setgroups() is per process.
_SETGROUPS = {"x86_64": 116, "aarch64": 159, "ppc64le": 81, "riscv64": 159, "s390x": 206}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_setfsuid = _libc.setfsuid  # two calls per operation: typed once, no objects per call
_setfsuid.argtypes, _setfsuid.restype = (ctypes.c_uint,), ctypes.c_int
_setfsgid = _libc.setfsgid
_setfsgid.argtypes, _setfsgid.restype = (ctypes.c_uint,), ctypes.c_int


def _current_fsuid() -> int:
    """setfsuid(-1) fails and returns the current fsuid (the documented probe)."""
    return _setfsuid(0xFFFFFFFF)


def _set_thread_groups(groups: list[int]) -> None:
    number = _SETGROUPS.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"no per-thread setgroups on {os.uname().machine}")
    array = (ctypes.c_uint * max(1, len(groups)))(*groups)
    if _libc.syscall(ctypes.c_long(number), ctypes.c_long(len(groups)), array) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setgroups: {os.strerror(code)}")


class CredsError(OSError):
    """The thread could not take the user's credentials: the operation is refused
    (never done as root)."""


class Creds:
    """A user's uid, gid and groups; `with creds:` runs the block as that user for
    file-system checks (re-entrant; a no-op when the daemon is that user already)."""

    def __init__(self, uid: int, gid: int, groups: list[int] | None = None) -> None:
        self.uid, self.gid = uid, gid
        self.groups = sorted(set(groups if groups is not None else [gid]))
        #: False when the process already is the user (a user's own daemon), or the user
        #: is root: nothing to switch.
        self.active = os.geteuid() == 0 and uid != 0
        self._local = threading.local()

    @classmethod
    def for_user(cls, uid: int, gid: int) -> Creds:
        """The user's supplementary groups from the user database (a job's user may
        reach a project's store through a group); just `gid` for an unnamed uid."""
        try:
            name = pwd.getpwuid(uid).pw_name
            groups = os.getgrouplist(name, gid)
        except (KeyError, OSError):
            groups = [gid]
        return cls(uid, gid, groups)

    @classmethod
    def none(cls) -> Creds:
        """This process's own credentials (a daemon mounting for itself)."""
        return cls(os.geteuid(), os.getegid())

    def __enter__(self) -> Creds:
        if not self.active:
            return self
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            self._become(local)
        local.depth = depth + 1
        return self

    def __exit__(self, *exc) -> None:
        if not self.active:
            return
        local = self._local
        local.depth -= 1
        if local.depth == 0:
            _setfsuid(0)
            _setfsgid(0)

    def _become(self, local) -> None:
        if not getattr(local, "checked", False):
            try:
                _set_thread_groups(self.groups)
            except OSError:
                _set_thread_groups([self.gid])  # at least none of root's groups
        _setfsgid(self.gid)
        _setfsuid(self.uid)
        if not getattr(local, "checked", False):
            # Once per thread: a root thread keeps CAP_SETUID, so a switch that took
            # once takes every time. Never go on as root if it did not.
            if _current_fsuid() != self.uid:
                _setfsuid(0)
                _setfsgid(0)
                raise CredsError(errno.EPERM, f"cannot act as uid {self.uid} "
                                              "(setfsuid failed)")
            local.checked = True

    def describe(self) -> str:
        return f"uid {self.uid}, gid {self.gid}" if self.active else "the daemon's own"


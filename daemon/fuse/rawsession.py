"""RawSession: a second FUSE connection that the daemon mounts and negotiates itself,
without libfuse: the checkpoint directory MOUNTPOINT/ckpt (dlfsd.ckpt).

Why a connection of its own: what a FUSE connection does with opens is decided for
the whole connection. The datasets want the kernel to open files without asking
the daemon (no_open: a cached file costs no request at all); the checkpoint tier
needs every OPEN and RELEASE (O_TRUNC, "closed, drain it now", FUSE passthrough).
On one connection the datasets paid a round trip per open for the tier's sake. As
a file system mounted on MOUNTPOINT/ckpt, the tier gets its own rules.

Why not libfuse: pyfuse3 runs one session per process, and libfuse 3.14 cannot ask
for passthrough (Linux >= 6.9: the kernel reads and writes a checkpoint file's
local copy itself, the daemon never sees the bytes). So this module mounts (mount(2)
as root, else fusermount3 handing the descriptor back over a socket, as libfuse
does) and answers INIT with the flags the tier wants.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import select
import socket
import struct
import subprocess
from dataclasses import dataclass

from dlfs.mountinfo import CKPT_FSTYPE, find_mount
from dlfsd.fuse import fusewire as fw

log = logging.getLogger(__name__)

FSTYPE = CKPT_FSTYPE  # not "fuse.dlfs": what lists DLFS mounts does not list it
MS_NOSUID, MS_NODEV, MS_NOATIME = 2, 4, 1024
MNT_DETACH = 2

INIT_IN = struct.Struct("<IIIIII")  # major minor max_readahead flags flags2 unused
# major minor max_readahead flags max_background congestion_threshold max_write
# time_gran max_pages map_alignment flags2 max_stack_depth unused[6]
INIT_OUT = struct.Struct("<IIIIHHIIHHII6I")
MINOR = 40  # the protocol minor we speak (passthrough came with 7.40)
ASYNC_READ, ATOMIC_O_TRUNC, BIG_WRITES = 1 << 0, 1 << 3, 1 << 5
AUTO_INVAL_DATA, DO_READDIRPLUS, READDIRPLUS_AUTO = 1 << 12, 1 << 13, 1 << 14
PARALLEL_DIROPS, MAX_PAGES, INIT_EXT = 1 << 18, 1 << 22, 1 << 30
# ABORT_ERROR: an aborted connection (fusectl, umount -f) reads ECONNABORTED, not the
# ENODEV of an unmount, so the workers tell the daemon (which then drains and exits)
ABORT_ERROR = 1 << 21
FLAGS = (ASYNC_READ | ATOMIC_O_TRUNC | BIG_WRITES | AUTO_INVAL_DATA | DO_READDIRPLUS
         | READDIRPLUS_AUTO | PARALLEL_DIROPS | ABORT_ERROR | MAX_PAGES | INIT_EXT)
FLAGS2_PASSTHROUGH = 1 << (37 - 32)
MAX_WRITE = 1 << 20  # 256 pages: the largest WRITE request (dlfsd.fuse.fusewire)
MAX_STACK_DEPTH = 2  # backing files may sit on an overlay (a container's /tmp)


@dataclass
class Negotiated:
    """What INIT settled: the kernel's protocol minor, and whether passthrough is on."""

    minor: int
    passthrough: bool


class RawSession:
    """One FUSE connection: /dev/fuse opened, mounted at `mountpoint`, INIT answered."""

    def __init__(self, mountpoint: str, uid: int, gid: int, allow_other: bool) -> None:
        self.mountpoint = mountpoint
        self.uid, self.gid = uid, gid
        self.allow_other = allow_other
        self.fd = -1

    def mount(self) -> None:
        """Mount (the kernel then queues INIT; answer it with answer_init)."""
        self._clear_stale()
        if os.geteuid() == 0:
            self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
            self._mount_syscall()
        else:
            self.fd = self._mount_fusermount()

    def _clear_stale(self) -> None:
        """A checkpoint connection a killed daemon left mounted here (a non-root daemon's
        lies outside the dataset mount, so nothing else detaches it): detach it, or the
        mount fails on a dead mountpoint (ENOTCONN)."""
        entry = find_mount(self.mountpoint)
        if entry is None or entry.fstype != FSTYPE:
            return
        log.info("detaching a checkpoint directory a stopped daemon left mounted on %s",
                 self.mountpoint)
        if os.geteuid() == 0:
            ctypes.CDLL(None, use_errno=True).umount2(os.fsencode(self.mountpoint),
                                                      MNT_DETACH)
        else:
            subprocess.run(["fusermount3", "-u", "-z", "-q", self.mountpoint],
                           capture_output=True, timeout=60)

    def _options(self) -> str:
        return "default_permissions" + (",allow_other" if self.allow_other else "")

    def _mount_syscall(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        data = (f"fd={self.fd},rootmode=40000,user_id={self.uid},group_id={self.gid},"
                f"{self._options()}").encode()
        if libc.mount(b"dlfs", os.fsencode(self.mountpoint), FSTYPE.encode(),
                      MS_NOSUID | MS_NODEV | MS_NOATIME, data) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            self.fd = -1
            raise OSError(err, f"cannot mount {self.mountpoint}: {os.strerror(err)}")

    def _mount_fusermount(self) -> int:
        """As an ordinary user: fusermount3 mounts and passes the descriptor back."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
            done = subprocess.run(
                ["fusermount3", "-o", f"fsname=dlfs,subtype=dlfs-ckpt,nosuid,nodev,noatime,"
                                      f"{self._options()}", "--", self.mountpoint],
                env=env, pass_fds=(theirs.fileno(),), capture_output=True, text=True,
                timeout=60)
            if done.returncode:
                raise OSError(errno.EPERM, f"cannot mount {self.mountpoint}: "
                                           f"{done.stderr.strip() or 'fusermount3 failed'}")
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        if not fds:
            raise OSError(errno.EIO, f"cannot mount {self.mountpoint}: fusermount3 passed "
                                     "no descriptor back")
        os.set_inheritable(fds[0], False)
        return fds[0]

    def answer_init(self, timeout: float, passthrough: bool) -> Negotiated:
        """Read the kernel's INIT and answer it; `passthrough`: ask for it if offered."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            raise TimeoutError(f"no FUSE INIT from the kernel for {self.mountpoint} in "
                               f"{timeout:.0f} s")
        buf = os.read(self.fd, fw.REQUEST_BUFFER)
        _, opcode, unique, *_ = fw.IN_HEADER.unpack_from(buf)
        if opcode != fw.INIT:
            raise OSError(errno.EPROTO, f"first FUSE request was opcode {opcode}, not INIT")
        major, minor, readahead, flags, flags2, _ = INIT_IN.unpack_from(buf, fw.IN_HEADER.size)
        if major != 7:
            os.write(self.fd, fw.error_reply(unique, errno.EPROTO))
            raise OSError(errno.EPROTO, f"FUSE protocol {major}.{minor} is not 7.x")
        offered = bool(flags & INIT_EXT and flags2 & FLAGS2_PASSTHROUGH)
        use = passthrough and offered
        reply = INIT_OUT.pack(7, min(minor, MINOR), readahead, FLAGS & flags, 0, 0, MAX_WRITE,
                              1, 256, 0, FLAGS2_PASSTHROUGH if use else 0,
                              MAX_STACK_DEPTH if use else 0, *[0] * 6)
        os.write(self.fd, fw.reply_header(unique, len(reply)) + reply)
        return Negotiated(minor, use)

    def unmount(self) -> None:
        """Unmount lazily (a process may still have it as its cwd) and close."""
        if self.fd < 0:
            return
        try:
            if os.geteuid() == 0:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.umount2(os.fsencode(self.mountpoint), MNT_DETACH) != 0:
                    err = ctypes.get_errno()
                    if err not in (errno.EINVAL, errno.ENOENT):  # not mounted (any more)
                        log.error("cannot unmount %s: %s", self.mountpoint, os.strerror(err))
            else:
                done = subprocess.run(["fusermount3", "-u", "-z", "-q", self.mountpoint],
                                      capture_output=True, text=True, timeout=60)
                if done.returncode and "not mounted" not in done.stderr:
                    log.error("cannot unmount %s: %s", self.mountpoint, done.stderr.strip())
        finally:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

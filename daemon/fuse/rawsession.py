"""RawSession: a FUSE connection that the daemon mounts and negotiates itself, without
libfuse: the datasets' mount (dlfsd.fuse.session) and the checkpoint directory
MOUNTPOINT/ckpt (dlfsd.ckpt).

Why the checkpoint directory is a connection of its own: what a FUSE connection does
with opens is decided for the whole connection. The datasets want the kernel to open
files without asking the daemon (no_open: a cached file costs no request at all); the
checkpoint tier needs every OPEN and RELEASE (O_TRUNC, "closed, drain it now", FUSE
passthrough). On one connection the datasets paid a round trip per open for the tier's
sake. As a file system mounted on MOUNTPOINT/ckpt, the tier gets its own rules.

Why not libfuse: INIT is where a connection's rules are set (which flags, how large a
request, how long the kernel waits for an answer), and libfuse answers it with its own
defaults. pyfuse3 can add a few capabilities and clear none (ATOMIC_O_TRUNC stays on a
read-only mount), and libfuse 3.14 knows neither passthrough (Linux >= 6.9) nor request
timeouts (6.14). So this module mounts (mount(2) as root, else fusermount3 handing the
descriptor back over a socket, as libfuse does) and answers INIT itself. `negotiate`
is the whole of that answer and does no I/O: what each connection asks for is a
`Wants`, what the kernel granted a `Negotiated`; the tests feed it synthetic INIT
requests with and without each offer.
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
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOATIME = 1, 2, 4, 1024
MNT_DETACH = 2

INIT_IN = struct.Struct("<IIIIII")  # major minor max_readahead flags flags2 unused
# major minor max_readahead flags max_background congestion_threshold max_write
# time_gran max_pages map_alignment flags2 max_stack_depth request_timeout unused[11]
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH11H")
MINOR = 40  # the protocol minor we speak (passthrough came with 7.40)

# INIT flags, include/uapi/linux/fuse.h; bits 32-63 travel in flags2 (with INIT_EXT).
ASYNC_READ, ATOMIC_O_TRUNC, BIG_WRITES = 1 << 0, 1 << 3, 1 << 5
AUTO_INVAL_DATA, DO_READDIRPLUS, READDIRPLUS_AUTO = 1 << 12, 1 << 13, 1 << 14
PARALLEL_DIROPS, MAX_PAGES, CACHE_SYMLINKS, INIT_EXT = 1 << 18, 1 << 22, 1 << 23, 1 << 30
# ABORT_ERROR: an aborted connection (fusectl, umount -f, an expired request timeout)
# reads ECONNABORTED, not the ENODEV of an unmount, so the workers tell the daemon
# (which then takes the dead mount down, draining checkpoints first)
ABORT_ERROR = 1 << 21
PASSTHROUGH = 1 << 37  # Linux 6.9 (7.40)
REQUEST_TIMEOUT = 1 << 42  # Linux 6.14 (7.43): request_timeout in fuse_init_out
FLAG_NAMES = {ASYNC_READ: "async_read", ATOMIC_O_TRUNC: "atomic_o_trunc",
              BIG_WRITES: "big_writes", AUTO_INVAL_DATA: "auto_inval_data",
              DO_READDIRPLUS: "readdirplus", READDIRPLUS_AUTO: "readdirplus_auto",
              PARALLEL_DIROPS: "parallel_dirops", ABORT_ERROR: "abort_error",
              MAX_PAGES: "max_pages", CACHE_SYMLINKS: "cache_symlinks",
              INIT_EXT: "init_ext", PASSTHROUGH: "passthrough",
              REQUEST_TIMEOUT: "request_timeout"}
MAX_WRITE = 1 << 20  # 256 pages: the largest WRITE request (dlfsd.fuse.fusewire)
MAX_STACK_DEPTH = 2  # backing files may sit on an overlay (a container's /tmp)
# The kernel looks for expired requests every 15 s and takes no timeout below that
# (fs/fuse: FUSE_TIMEOUT_TIMER_FREQ): a request fails between T and T + 15 s.
TIMEOUT_CHECK_SECONDS = 15
MAX_REQUEST_TIMEOUT = 0xFFFF  # a u16 in fuse_init_out
DEFAULT_MAX_PAGES = 32  # the kernel's max_pages without MAX_PAGES (128 KiB requests)


@dataclass(frozen=True)
class Wants:
    """What a connection asks of INIT: flags it takes where the kernel offers them, the
    largest request, and the request timeout (seconds; 0: none)."""

    flags: int
    max_pages: int = MAX_WRITE // 4096
    request_timeout: int = 0
    max_stack_depth: int = 0  # with PASSTHROUGH


def dataset_wants(request_timeout: int, passthrough: bool = False) -> Wants:
    """The datasets' connection: read-only, immutable, listed and looked up in parallel.

    parallel_dirops: DataLoader workers look up names of one directory at once (without
    it the kernel serializes them on the directory's lock). max_pages 256: 1 MiB READ
    and READDIRPLUS requests. readdirplus without readdirplus_auto: every listing
    reply carries the entries' attributes, not only the first (~6,000 entries of 1
    MiB): with readdirplus_auto the rest of a larger directory came without them, and
    each later stat or open of one cost a LOOKUP round trip (docs/ARCHITECTURE.md,
    "Listings"). async_read and auto_inval_data: as libfuse asked before.
    cache_symlinks: a link's target never changes, so the kernel may keep it. No
    atomic_o_trunc, big_writes, locks: nothing is ever written. abort_error: see
    ABORT_ERROR. request_timeout: a hung or stopped daemon fails readers' requests
    (the kernel aborts the connection) instead of leaving them in D state forever.
    Opens and opendirs are not negotiated here: the workers' ENOSYS answers make the
    kernel stop sending them (dlfsd.fuse.wireworker). `passthrough`: the mount serves
    large files from whole-file copies on the node (dlfsd.core.passthrough); then the
    workers answer every OPEN instead."""
    flags = (ASYNC_READ | AUTO_INVAL_DATA | DO_READDIRPLUS | PARALLEL_DIROPS | ABORT_ERROR
             | MAX_PAGES | CACHE_SYMLINKS | INIT_EXT)
    if request_timeout:
        flags |= REQUEST_TIMEOUT
    if passthrough:
        flags |= PASSTHROUGH
    return Wants(flags, request_timeout=min(request_timeout, MAX_REQUEST_TIMEOUT),
                 max_stack_depth=MAX_STACK_DEPTH if passthrough else 0)


def ckpt_wants(passthrough: bool) -> Wants:
    """The checkpoint directory's connection: written through opens (atomic O_TRUNC),
    1 MiB writes, and passthrough if wanted (dlfsd.ckpt)."""
    flags = (ASYNC_READ | ATOMIC_O_TRUNC | BIG_WRITES | AUTO_INVAL_DATA | DO_READDIRPLUS
             | READDIRPLUS_AUTO | PARALLEL_DIROPS | ABORT_ERROR | MAX_PAGES | INIT_EXT)
    if passthrough:
        return Wants(flags | PASSTHROUGH, max_stack_depth=MAX_STACK_DEPTH)
    return Wants(flags)


@dataclass(frozen=True)
class KernelLimits:
    """The kernel's caps on what INIT may ask (/proc/sys/fs/fuse/, Linux >= 6.14; a
    kernel without them caps max_pages at 256 and has no request timeouts to cap)."""

    max_pages: int = 256
    max_request_timeout: int = 0  # 0: no cap
    default_request_timeout: int = 0  # what a connection that asks none gets

    @classmethod
    def read(cls, where: str = "/proc/sys/fs/fuse") -> KernelLimits:
        def value(name: str, default: int) -> int:
            try:
                with open(os.path.join(where, name)) as f:
                    return int(f.read())
            except (OSError, ValueError):
                return default

        return cls(value("max_pages_limit", 256), value("max_request_timeout", 0),
                   value("default_request_timeout", 0))


@dataclass(frozen=True)
class Negotiated:
    """What INIT settled: the protocol minor in use, the flags the kernel offered and
    those it was answered with (granted), and the limits that follow."""

    minor: int
    kernel_minor: int
    offered: int
    granted: int
    max_pages: int
    request_timeout: int  # seconds the kernel waits for an answer (0: forever)

    @property
    def passthrough(self) -> bool:
        return bool(self.granted & PASSTHROUGH)

    def has(self, flag: int) -> bool:
        return bool(self.granted & flag)

    def names(self, flags: int) -> list[str]:
        return [name for bit, name in FLAG_NAMES.items() if flags & bit and bit != INIT_EXT]

    def report(self, wants: Wants) -> dict:
        """For the status file (`dlfs status`): what was asked and not granted too."""
        return {"protocol": f"7.{self.minor}", "kernel_protocol": f"7.{self.kernel_minor}",
                "granted": self.names(self.granted),
                "not_granted": self.names(wants.flags & ~self.granted),
                "max_pages": self.max_pages, "request_timeout": self.request_timeout}

    def describe(self, wants: Wants) -> str:
        """One line for the log at mount."""
        missing = self.names(wants.flags & ~self.granted)
        timeout = (f"request timeout {self.request_timeout} s" if self.request_timeout
                   else "no request timeout" + (
                       " (the kernel does not offer one; Linux >= 6.14 does)"
                       if wants.flags & REQUEST_TIMEOUT and not self.has(REQUEST_TIMEOUT)
                       else ""))
        return (f"protocol 7.{self.minor} (kernel 7.{self.kernel_minor}), granted "
                f"{', '.join(self.names(self.granted)) or 'nothing'}; max_pages "
                f"{self.max_pages}; {timeout}"
                + (f"; not offered: {', '.join(missing)}" if missing else ""))


class InitRefused(OSError):
    """The kernel's INIT cannot be answered; `reply` (if any) must still be written so
    that the kernel fails the mount instead of waiting."""

    def __init__(self, message: str, reply: bytes | None = None) -> None:
        super().__init__(errno.EPROTO, message)
        self.reply = reply


def negotiate(request: bytes | bytearray | memoryview, wants: Wants,
              limits: KernelLimits = KernelLimits()) -> tuple[bytes, Negotiated]:
    """The reply to the kernel's INIT `request` (as read from /dev/fuse) for `wants`,
    and what it grants. Pure: no I/O."""
    _, opcode, unique, *_ = fw.IN_HEADER.unpack_from(request)
    if opcode != fw.INIT:
        raise InitRefused(f"first FUSE request was opcode {opcode}, not INIT")
    major, minor, readahead, flags, flags2, _ = INIT_IN.unpack_from(request, fw.IN_HEADER.size)
    if major != 7:
        raise InitRefused(f"FUSE protocol {major}.{minor} is not 7.x",
                          fw.error_reply(unique, errno.EPROTO))
    offered = flags | (flags2 << 32 if flags & INIT_EXT else 0)
    granted = wants.flags & offered
    max_pages = min(wants.max_pages, limits.max_pages) if granted & MAX_PAGES \
        else DEFAULT_MAX_PAGES
    timeout = wants.request_timeout if granted & REQUEST_TIMEOUT else 0
    effective = 0
    if offered & REQUEST_TIMEOUT:  # the kernel's own rule (fuse_init_server_timeout)
        effective = timeout or limits.default_request_timeout
        if limits.max_request_timeout:
            effective = min(effective or limits.max_request_timeout,
                            limits.max_request_timeout)
        if effective:
            effective = max(effective, TIMEOUT_CHECK_SECONDS)
    reply = INIT_OUT.pack(7, min(minor, MINOR), readahead, granted & 0xFFFFFFFF, 0, 0,
                          MAX_WRITE, 1, wants.max_pages, 0, granted >> 32,
                          wants.max_stack_depth if granted & PASSTHROUGH else 0, timeout,
                          *[0] * 11)
    return (fw.reply_header(unique, len(reply)) + reply,
            Negotiated(min(minor, MINOR), minor, offered, granted, max_pages, effective))


class RawSession:
    """One FUSE connection: /dev/fuse opened, mounted at `mountpoint`, INIT answered.

    `subtype` names the file system type (fuse.SUBTYPE): dlfs-ckpt by default, dlfs for
    the datasets' mount (what dlfs.mountinfo lists as a DLFS mount); `read_only` mounts
    it read-only (MS_RDONLY, `ro`)."""

    def __init__(self, mountpoint: str, uid: int, gid: int, allow_other: bool,
                 subtype: str = FSTYPE.removeprefix("fuse."), read_only: bool = False) -> None:
        self.mountpoint = mountpoint
        self.uid, self.gid = uid, gid
        self.allow_other = allow_other
        self.subtype = subtype
        self.read_only = read_only
        self.fd = -1

    @property
    def fstype(self) -> str:
        return f"fuse.{self.subtype}"

    def mount(self) -> None:
        """Mount (the kernel then queues INIT; answer it with serve_init)."""
        if self.fstype == FSTYPE:
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

    def _flags(self) -> int:
        return MS_NOSUID | MS_NODEV | MS_NOATIME | (MS_RDONLY if self.read_only else 0)

    def _mount_syscall(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        data = (f"fd={self.fd},rootmode=40000,user_id={self.uid},group_id={self.gid},"
                f"{self._options()}").encode()
        if libc.mount(b"dlfs", os.fsencode(self.mountpoint), self.fstype.encode(),
                      self._flags(), data) != 0:
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
                ["fusermount3", "-o", f"fsname=dlfs,subtype={self.subtype},nosuid,nodev,"
                                      f"noatime,{'ro,' if self.read_only else ''}"
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
        """The checkpoint directory's INIT; `passthrough`: ask for it if offered."""
        return self.serve_init(timeout, ckpt_wants(passthrough))

    def serve_init(self, timeout: float, wants: Wants) -> Negotiated:
        """Read the kernel's INIT (within `timeout` seconds) and answer it for `wants`."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            raise TimeoutError(f"no FUSE INIT from the kernel for {self.mountpoint} in "
                               f"{timeout:.0f} s")
        request = os.read(self.fd, fw.REQUEST_BUFFER)
        try:
            reply, negotiated = negotiate(request, wants, KernelLimits.read())
        except InitRefused as err:
            if err.reply is not None:
                os.write(self.fd, err.reply)
            raise
        os.write(self.fd, reply)
        return negotiated

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
            self.close()

    def close(self) -> None:
        """Close our descriptor, leaving the mount as it is (the kernel unmounted it)."""
        with contextlib.suppress(OSError):
            if self.fd >= 0:
                os.close(self.fd)
        self.fd = -1

"""The FUSE kernel wire format: request headers in, replies out (no libfuse, no pyfuse3).

Worker processes (dlfsd.fuse.wireworker) speak this directly on the mount's
/dev/fuse descriptor once the main process has mounted and answered INIT
(dlfsd.fuse.session, dlfsd.fuse.rawsession). Only what a read-only file system needs is here:
the layouts of `include/uapi/linux/fuse.h` for the requests we read and the
replies we write, x86-64/aarch64 little-endian, protocol 7.x (the layouts used
below have been stable since 7.9).
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct

from dlfsd.core.values import StatFs, st_blksize, st_blocks

# Opcodes (enum fuse_opcode).
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
ACCESS = 34
CREATE = 35
INTERRUPT = 36
DESTROY = 38
BATCH_FORGET = 42
FALLOCATE = 43
READDIRPLUS = 44
RENAME2 = 45
COPY_FILE_RANGE = 47
TMPFILE = 51

#: Requests that change the file system, by the core's name for them
#: (dlfsd.core.namespace.CHANGE_REQUESTS: the Namespace refuses them all).
MUTATING = {SETATTR: "setattr", SYMLINK: "symlink", MKNOD: "mknod", MKDIR: "mkdir",
            UNLINK: "unlink", RMDIR: "rmdir", RENAME: "rename", LINK: "link", WRITE: "write",
            SETXATTR: "setxattr", REMOVEXATTR: "removexattr", CREATE: "create",
            FALLOCATE: "fallocate", RENAME2: "rename", COPY_FILE_RANGE: "copy_file_range",
            TMPFILE: "tmpfile"}
#: Requests the kernel sends without expecting a reply.
NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})

#: Notification (written to /dev/fuse with unique 0, the code in the error field): the
#: kernel queues again every request read but not answered yet (Linux >= 6.9).
NOTIFY_RESEND = 7

FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3  # the kernel may cache this directory's entries (readdir)
FOPEN_PASSTHROUGH = 1 << 7  # the kernel reads (and writes) the open's backing file itself

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
READ_IN = struct.Struct("<QQII")  # fh offset size read_flags (lock_owner, flags follow)
RELEASE_IN = struct.Struct("<QII")  # fh flags release_flags
OPEN_IN = struct.Struct("<II")  # flags open_flags
SIZE_IN = struct.Struct("<II")  # getxattr_in / listxattr_in: size, padding
ACCESS_IN = struct.Struct("<II")  # mask, padding
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
# -- the writable checkpoint subtree (dlfsd.ckpt) --
WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags padding
WRITE_OUT = struct.Struct("<II")  # size padding
# valid padding fh size lock_owner atime mtime ctime atimensec mtimensec ctimensec mode
# unused4 uid gid unused5
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags, then the name
MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask padding, then the name
MKDIR_IN = struct.Struct("<II")  # mode umask, then the name
RENAME_IN = struct.Struct("<Q")  # newdir, then oldname NUL newname NUL
RENAME2_IN = struct.Struct("<QII")  # newdir flags padding, then the names
FSYNC_IN = struct.Struct("<QII")  # fh fsync_flags padding
FALLOCATE_IN = struct.Struct("<QQQII")  # fh offset length mode padding
FATTR_MODE, FATTR_SIZE, FATTR_ATIME, FATTR_MTIME = 1 << 0, 1 << 3, 1 << 4, 1 << 5
FATTR_ATIME_NOW, FATTR_MTIME_NOW = 1 << 7, 1 << 8
FSYNC_FDATASYNC = 1
XATTR_SIZE_OUT = struct.Struct("<II")  # size padding
# fuse_entry_out = nodeid generation entry_valid attr_valid entry_nsec attr_nsec + fuse_attr;
# fuse_attr = ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink
#             uid gid rdev blksize flags (times before 1970 as two's complement: "q")
ENTRY_OUT = struct.Struct("<QQQQII" "QQQqqqIIIIIIIIII")
ATTR_OUT = struct.Struct("<QII" "QQQqqqIIIIIIIIII")  # attr_valid attr_nsec dummy + fuse_attr
STATFS_OUT = struct.Struct("<QQQQQIIII24x")  # blocks bfree bavail files ffree bsize namelen frsize
DIRENT = struct.Struct("<QQII")  # ino off namelen type, then the name, padded to 8 bytes

#: A read of /dev/fuse must offer room for the largest request (a max_write WRITE), or
#: the kernel refuses it (EINVAL): libfuse negotiates 256 pages, 1 MiB with 4 KiB pages
#: but 16 MiB with the 64 KiB pages of some aarch64 kernels; plus headers, with a margin.
REQUEST_BUFFER = 256 * os.sysconf("SC_PAGE_SIZE") + (64 << 10)


# FUSE passthrough (Linux >= 6.9): a backing file registered on the connection is named
# by its id in the answer to OPEN. _IOW(229, 1, struct fuse_backing_map), _IOW(229, 2, u32).
BACKING_OPEN, BACKING_CLOSE = 0x4010E501, 0x4004E502
BACKING_MAP = struct.Struct("<iIQ")  # fuse_backing_map: fd, flags, padding


def open_backing(conn_fd: int, fd: int) -> int:
    """Register the file open as `fd` as a backing file on the FUSE connection `conn_fd`;
    returns its backing id (> 0). The kernel takes its own reference to the file (the
    caller may close `fd`) and the registering thread's credentials for its I/O. Needs
    CAP_SYS_ADMIN; OSError otherwise, or where the file cannot back one (a file system
    stacked deeper than the connection's max_stack_depth: ELOOP)."""
    return fcntl.ioctl(conn_fd, BACKING_OPEN, bytearray(BACKING_MAP.pack(fd, 0, 0)), True)


def close_backing(conn_fd: int, backing_id: int) -> None:
    """Unregister a backing id (opens that use it keep the file until released)."""
    fcntl.ioctl(conn_fd, BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)), True)


def error_reply(unique: int, errno_value: int) -> bytes:
    """A reply that carries only an error (errno_value > 0) or success with no data (0)."""
    return OUT_HEADER.pack(OUT_HEADER.size, -errno_value, unique)


def resend_notification() -> bytes:
    """NOTIFY_RESEND: the requests a dead worker had read go back to the queue."""
    return OUT_HEADER.pack(OUT_HEADER.size, NOTIFY_RESEND, 0)


def reply_header(unique: int, payload_len: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + payload_len, 0, unique)


def _seconds(timeout: float) -> tuple[int, int]:
    whole = int(timeout)
    return whole, int((timeout - whole) * 1e9)


class AttrPacker:
    """Packs entry/attr replies for one mount (owner and cache timeouts fixed)."""

    def __init__(self, uid: int, gid: int, timeout: float) -> None:
        self.uid, self.gid = uid, gid
        self.valid, self.valid_ns = _seconds(timeout)

    blksize = staticmethod(st_blksize)

    def _attr(self, ino: int, mode: int, size: int, mtime_ns: int, nlink: int) -> tuple:
        sec, nsec = divmod(mtime_ns, 1_000_000_000)
        return (ino, size, st_blocks(size), sec, sec, sec, nsec, nsec, nsec, mode, nlink,
                self.uid, self.gid, 0, self.blksize(mode), 0)

    def entry(self, attr) -> bytes:
        """fuse_entry_out for a dlfsd.core.values.Attr."""
        v, vn = self.valid, self.valid_ns
        return ENTRY_OUT.pack(attr.ino, 0, v, v, vn, vn, *self._attr(*attr))

    def attr(self, attr) -> bytes:
        """fuse_attr_out for a dlfsd.core.values.Attr."""
        return ATTR_OUT.pack(self.valid, self.valid_ns, 0, *self._attr(*attr))


class CkptAttrPacker(AttrPacker):
    """Checkpoint entries: 1 MiB st_blksize (Python's buffered writer then hands the
    kernel 1 MiB writes, its largest WRITE request)."""

    blksize = staticmethod(lambda mode: 1 << 20)


def dirent(name: bytes, ino: int, mode: int, next_offset: int) -> bytes:
    """One fuse_dirent (READDIR), padded to a multiple of 8 bytes."""
    head = DIRENT.pack(ino, next_offset, len(name), stat.S_IFMT(mode) >> 12)
    return head + name + b"\0" * (-(DIRENT.size + len(name)) % 8)


def statfs(s: StatFs) -> bytes:
    """fuse_statfs_out of the core's StatFs."""
    return STATFS_OUT.pack(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namemax,
                           s.frsize, 0)

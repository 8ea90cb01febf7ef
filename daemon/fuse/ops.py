"""DlfsOperations: the pyfuse3 adapter. Translates and delegates; no storage logic.

Each handler turns a kernel request into one Namespace call and the result
into pyfuse3 types. `errno_boundary` turns every exception into a FUSEError
through dlfsd.fuse.errnomap (the table the worker processes use too): anything
but FUSEError escaping a handler would leave the request unanswered.
"""

from __future__ import annotations

import functools
import os
import stat

import pyfuse3

from dlfs.errors import ReadOnlyError
from dlfsd.fuse.errnomap import errno_for
from dlfsd.fuse.fusewire import BLKSIZE, DIR_BLKSIZE
from dlfsd.namespace import Attr, Namespace

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


def errno_boundary(handler):
    """Map any exception raised by a handler to a FUSEError (see module doc)."""

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as err:
            raise pyfuse3.FUSEError(errno_for(err, handler.__name__)) from None

    return wrapper


def _read_only(name: str):
    @errno_boundary
    async def refuse(self, *args, **kwargs):
        raise ReadOnlyError(name)

    refuse.__name__ = name
    return refuse


class DlfsOperations(pyfuse3.Operations):
    """Read-only FUSE operations over a Namespace."""

    def __init__(self, namespace: Namespace, cache_timeout: float = 86400.0,
                 uid: int | None = None, gid: int | None = None) -> None:
        super().__init__()
        self.ns = namespace
        self.timeout = cache_timeout
        self.uid = os.getuid() if uid is None else uid  # owner shown for every entry
        self.gid = os.getgid() if gid is None else gid
        self.on_init = lambda: None  # called once the kernel's INIT request is answered

    def init(self):
        self.on_init()

    def entry(self, attr: Attr) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = attr.ino
        e.st_mode = attr.mode
        e.st_nlink = attr.nlink
        e.st_size = attr.size
        e.st_blocks = (attr.size + 511) // 512
        e.st_blksize = DIR_BLKSIZE if stat.S_ISDIR(attr.mode) else BLKSIZE
        e.st_uid = self.uid
        e.st_gid = self.gid
        e.st_mtime_ns = e.st_ctime_ns = e.st_atime_ns = attr.mtime_ns
        e.entry_timeout = e.attr_timeout = self.timeout
        return e

    @errno_boundary
    async def lookup(self, parent_inode, name, ctx=None):
        return self.entry(self.ns.getattr(self.ns.lookup(parent_inode, name, ctx)))

    @errno_boundary
    async def getattr(self, inode, ctx=None):
        return self.entry(self.ns.getattr(inode, ctx))

    @errno_boundary
    async def readlink(self, inode, ctx=None):
        return self.ns.readlink(inode)

    @errno_boundary
    async def opendir(self, inode, ctx=None):
        self.ns.check_dir(inode)
        return inode

    @errno_boundary
    async def readdir(self, fh, start_id, token):
        for name, attr, next_id in self.ns.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self.entry(attr), next_id):
                break

    async def releasedir(self, fh):
        pass

    @errno_boundary
    async def open(self, inode, flags, ctx=None):
        if flags & _WRITE_FLAGS:
            raise ReadOnlyError(inode)
        # Dataset files: data never changes, so the kernel may keep its page cache
        # across opens. `.dlfs/` files: rendered per open, never cached (direct_io).
        fh, direct_io = self.ns.open(inode, ctx)
        return pyfuse3.FileInfo(fh=fh, keep_cache=not direct_io, direct_io=direct_io)

    @errno_boundary
    async def read(self, fh, off, size):
        return await self.ns.read(fh, off, size)

    @errno_boundary
    async def release(self, fh):
        self.ns.release(fh)

    async def forget(self, inode_list):
        pass

    @errno_boundary
    async def access(self, inode, mode, ctx=None):
        if mode & os.W_OK:
            raise ReadOnlyError(inode)
        self.ns.getattr(inode)

    @errno_boundary
    async def statfs(self, ctx=None):
        nbytes, entries = self.ns.totals()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (nbytes + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = entries
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    @errno_boundary
    async def getxattr(self, inode, name, ctx=None):
        self.ns.getattr(inode)
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @errno_boundary
    async def listxattr(self, inode, ctx=None):
        self.ns.getattr(inode)
        return []

    setattr = _read_only("setattr")
    mknod = _read_only("mknod")
    mkdir = _read_only("mkdir")
    unlink = _read_only("unlink")
    rmdir = _read_only("rmdir")
    symlink = _read_only("symlink")
    rename = _read_only("rename")
    link = _read_only("link")
    create = _read_only("create")
    write = _read_only("write")
    setxattr = _read_only("setxattr")
    removexattr = _read_only("removexattr")

"""DlfsOperations: the pyfuse3 adapter. Translates and delegates; no storage logic.

Each handler turns a kernel request into one Namespace call and the result
into pyfuse3 types. `errno_boundary` turns every exception into a FUSEError
through dlfsd.fuse.errnomap (the table the worker processes use too): anything
but FUSEError escaping a handler would leave the request unanswered.
"""

from __future__ import annotations

import functools
import os

import pyfuse3

from dlfsd.fuse.errnomap import errno_for
from dlfsd.namespace import CHANGE_REQUESTS, Attr, Namespace, st_blksize, st_blocks


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
        self.ns.refuse_change(name)

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
        e.st_blocks = st_blocks(attr.size)
        e.st_blksize = st_blksize(attr.mode)
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
        self.ns.check_open(inode, flags)
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
        self.ns.check_access(inode, mode)

    @errno_boundary
    async def statfs(self, ctx=None):
        core = self.ns.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize, s.f_frsize, s.f_namemax = core.bsize, core.frsize, core.namemax
        s.f_blocks, s.f_bfree, s.f_bavail = core.blocks, core.bfree, core.bavail
        s.f_files, s.f_ffree, s.f_favail = core.files, core.ffree, core.ffree
        return s

    @errno_boundary
    async def getxattr(self, inode, name, ctx=None):
        return self.ns.getxattr(inode, name)

    @errno_boundary
    async def listxattr(self, inode, ctx=None):
        return self.ns.listxattr(inode)


# Every request that would change the file system: the core refuses it (EROFS).
for _name in CHANGE_REQUESTS:
    if hasattr(pyfuse3.Operations, _name):
        setattr(DlfsOperations, _name, _read_only(_name))

"""CkptWorker: a forked worker process serving the checkpoint directory's own FUSE
connection (MOUNTPOINT/ckpt, dlfsd.fuse.rawsession), straight off /dev/fuse.

It translates and delegates like the dataset workers: each request becomes one
dlfsd.ckpt.tree.CkptTree call. The connection's root (node id 1) is the tree's
root; every other node id is the tree's own (CKPT_BIT | st_ino of the backing
entry). Opens are always answered: O_TRUNC is done by the answer (the connection
asks for atomic O_TRUNC), RELEASE says a written file is closed (its drain may
begin), every open is counted (an open file is never evicted), and with FUSE
passthrough the answer names the local copy the kernel then reads and writes by
itself (dlfsd.ckpt.openfiles).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time

from dlfsd.base.nodeids import CKPT_BIT
from dlfsd.ckpt.openfiles import OpenFiles
from dlfsd.ckpt.opens import Opens
from dlfsd.ckpt.tree import CkptTree
from dlfsd.core.values import CkptCalls
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse.listing import pack_entries
from dlfsd.fuse.requestloop import HEADER, Errno, RequestLoop

log = logging.getLogger("dlfsd")

ROOT_ID = 1  # FUSE_ROOT_ID: the connection's root, the tree's root
CKPT_ATTR_TIMEOUT = 1.0  # seconds the kernel keeps a checkpoint entry's attributes
FOPEN_PASSTHROUGH = fw.FOPEN_PASSTHROUGH
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR

#: Checkpoint files opened for writing bypass the kernel's page cache (the backing file
#: has one already): each write() reaches the daemon as it is (up to max_write), with
#: one copy less and no second cached copy; set DLFS_CKPT_CACHED_WRITES=1 to compare.
#: (Without passthrough only: with it, the daemon sees no write at all.)
CKPT_DIRECT_WRITES = os.environ.get("DLFS_CKPT_CACHED_WRITES") != "1"


def served_open_flags(flags: int) -> int:
    """FOPEN flags of a file the daemon serves (no passthrough)."""
    if CKPT_DIRECT_WRITES and flags & WRITE_FLAGS:
        return fw.FOPEN_DIRECT_IO
    return fw.FOPEN_KEEP_CACHE


class CkptWorker(RequestLoop):
    """Serves the checkpoint connection's requests from `fd` until unmount or SIGTERM.

    `open_files`: the open files shared by all workers; `passthrough`: the kernel
    granted FUSE passthrough (else every READ and WRITE comes here)."""

    def __init__(self, namespace: CkptCalls, tree: CkptTree, fd: int, uid: int, gid: int,
                 open_files: OpenFiles, passthrough: bool = False) -> None:
        super().__init__(fd)
        self.ns, self.tree = namespace, tree
        self.passthrough = passthrough
        self.opens = Opens(tree, open_files, passthrough)  # what opens and closes mean
        self._opened = 0  # the inode the OPEN/CREATE being answered counted (_reply_lost)
        self._opened_writing = False  # and whether that open may write
        self._register_warned = False
        self.root = tree.root_nodeid
        self.attrs = fw.CkptAttrPacker(uid, gid, CKPT_ATTR_TIMEOUT)
        self._handlers = {
            fw.LOOKUP: self.lookup, fw.GETATTR: self.getattr, fw.SETATTR: self.setattr,
            fw.READLINK: self.readlink, fw.SYMLINK: self.symlink, fw.MKNOD: self.mknod,
            fw.MKDIR: self.mkdir, fw.UNLINK: self.unlink, fw.RMDIR: self.rmdir,
            fw.RENAME: self.rename, fw.RENAME2: self.rename2, fw.LINK: self.link,
            fw.OPEN: self.open, fw.READ: self.read, fw.WRITE: self.write,
            fw.STATFS: self.statfs, fw.RELEASE: self.release, fw.FSYNC: self.fsync,
            fw.OPENDIR: self.opendir, fw.READDIR: self.readdir,
            fw.READDIRPLUS: self.readdirplus, fw.RELEASEDIR: self.empty,
            fw.FSYNCDIR: self.fsync, fw.ACCESS: self.access, fw.CREATE: self.create,
            fw.FALLOCATE: self.fallocate, fw.DESTROY: self.empty,
        }

    def _node(self, nodeid: int) -> int:
        return self.root if nodeid == ROOT_ID else nodeid

    # -- metadata ----------------------------------------------------------------------
    def lookup(self, nodeid: int, n: int) -> bytes:
        return self.attrs.entry(self.tree.lookup(self._node(nodeid), self._name_arg(n)))

    def getattr(self, nodeid: int, n: int) -> bytes:
        return self.attrs.attr(self.tree.getattr(self._node(nodeid)))

    def setattr(self, nodeid: int, n: int) -> bytes:
        (valid, _, _, size, _, atime, mtime, _, atimensec, mtimensec, _, mode, _, _, _,
         _) = fw.SETATTR_IN.unpack_from(self._buf, HEADER)
        attr = self.tree.setattr(
            self._node(nodeid), mode=mode if valid & fw.FATTR_MODE else None,
            size=size if valid & fw.FATTR_SIZE else None,
            atime_ns=atime * 1_000_000_000 + atimensec if valid & fw.FATTR_ATIME else None,
            mtime_ns=mtime * 1_000_000_000 + mtimensec if valid & fw.FATTR_MTIME else None,
            now_atime=bool(valid & fw.FATTR_ATIME_NOW),
            now_mtime=bool(valid & fw.FATTR_MTIME_NOW))
        return self.attrs.attr(attr)

    def readlink(self, nodeid: int, n: int) -> bytes:
        return self.tree.readlink(self._node(nodeid))

    def statfs(self, nodeid: int, n: int) -> bytes:
        return fw.statfs(self.tree.statfs())

    def access(self, nodeid: int, n: int) -> None:
        self.tree.getattr(self._node(nodeid))  # the kernel checks modes (default_permissions)

    # -- entries ---------------------------------------------------------------------------
    def create(self, nodeid: int, n: int) -> bytes:
        flags, mode, umask, _ = fw.CREATE_IN.unpack_from(self._buf, HEADER)
        name = self._name_arg(n, HEADER + fw.CREATE_IN.size)
        attr = self.tree.create(self._node(nodeid), name, flags, mode & ~umask)
        return self.attrs.entry(attr) + self._open_reply(attr.ino, flags)

    def mknod(self, nodeid: int, n: int) -> bytes:
        mode, _, umask, _ = fw.MKNOD_IN.unpack_from(self._buf, HEADER)
        name = self._name_arg(n, HEADER + fw.MKNOD_IN.size)
        return self.attrs.entry(self.tree.mknod(self._node(nodeid), name, mode & ~umask))

    def mkdir(self, nodeid: int, n: int) -> bytes:
        mode, umask = fw.MKDIR_IN.unpack_from(self._buf, HEADER)
        name = self._name_arg(n, HEADER + fw.MKDIR_IN.size)
        return self.attrs.entry(self.tree.mkdir(self._node(nodeid), name, mode & ~umask))

    def symlink(self, nodeid: int, n: int) -> bytes:
        name = self._name_arg(n)
        target = self._name_arg(n, HEADER + len(name) + 1)
        return self.attrs.entry(self.tree.symlink(self._node(nodeid), name, target))

    def link(self, nodeid: int, n: int) -> None:
        raise Errno(errno.EPERM)  # hard links: one path per file keeps the store a mirror

    def unlink(self, nodeid: int, n: int) -> None:
        self.tree.unlink(self._node(nodeid), self._name_arg(n))

    def rmdir(self, nodeid: int, n: int) -> None:
        self.tree.rmdir(self._node(nodeid), self._name_arg(n))

    def rename(self, nodeid: int, n: int) -> None:
        (new_dir,) = fw.RENAME_IN.unpack_from(self._buf, HEADER)
        self._rename(nodeid, new_dir, 0, HEADER + fw.RENAME_IN.size, n)

    def rename2(self, nodeid: int, n: int) -> None:
        new_dir, flags, _ = fw.RENAME2_IN.unpack_from(self._buf, HEADER)
        self._rename(nodeid, new_dir, flags, HEADER + fw.RENAME2_IN.size, n)

    def _rename(self, nodeid: int, new_dir: int, flags: int, start: int, n: int) -> None:
        old = self._name_arg(n, start)
        new = self._name_arg(n, start + len(old) + 1)
        self.tree.rename(self._node(nodeid), old, self._node(new_dir), new, flags)

    # -- data ------------------------------------------------------------------------------
    def open(self, nodeid: int, n: int) -> bytes:
        flags, _ = fw.OPEN_IN.unpack_from(self._buf, HEADER)
        node = self._node(nodeid)
        self.tree.open(node, flags)
        return self._open_reply(node, flags)

    def _open_reply(self, node: int, flags: int) -> bytes:
        """fuse_open_out: the open counted, passed through to the local copy where it can
        be, else served here.

        The handle says who opened it and when (its RELEASE comes from the kernel,
        pid 0, and must count and trace the writes) and whether it was counted."""
        ino = node & ~CKPT_BIT
        writing = bool(flags & WRITE_FLAGS)
        backing_id = self.opens.opened(node, writing, lambda: self._register(node))
        self._opened = ino if backing_id >= 0 else 0
        self._opened_writing = writing
        fh = (self.caller.pid << 32 | (int(time.time()) & 0x7FFFFFFF) << 1
              | (backing_id >= 0))
        if backing_id > 0:  # (a write-open is pending already: CkptTree.open)
            return fw.OPEN_OUT.pack(fh, FOPEN_PASSTHROUGH, backing_id)
        if self.passthrough:  # an evicted file read from the store's copy: no page cache
            return fw.OPEN_OUT.pack(fh, fw.FOPEN_DIRECT_IO, 0)  # (a cached open would bar
        return fw.OPEN_OUT.pack(fh, served_open_flags(flags), 0)  # passthrough opens)

    def _reply_lost(self, opcode: int) -> None:
        """The opener was interrupted before our answer to OPEN/CREATE arrived: the
        kernel will send no RELEASE for it, so it must not stay counted."""
        if opcode in (fw.OPEN, fw.CREATE) and self._opened:
            self.opens.lost(self._opened, self._opened_writing, self._unregister)
            self._opened = 0

    def _register(self, node: int) -> int:
        """A backing id for `node`'s local copy; 0 (served here) if the kernel refuses
        one (logged once per process: e.g. a cache dir on a stacked file system). The
        kernel keeps the credentials of the registering thread for the backing file's
        I/O: the job user's (CAP_SYS_ADMIN, which the ioctl needs, is no file capability
        and stays)."""
        local = self.tree.local
        fd = local.open(self.tree.path_of(node), os.O_RDONLY)
        try:
            with local.creds:
                return fw.open_backing(self.fd, fd)
        except OSError as err:
            if not self._register_warned:
                self._register_warned = True
                log.warning("worker %d: FUSE passthrough refused for a checkpoint file (%s); "
                            "such files are served by the daemon", os.getpid(), err.strerror)
            return 0
        finally:
            os.close(fd)  # the kernel holds its own reference now

    def _unregister(self, backing_id: int) -> None:
        try:
            fw.close_backing(self.fd, backing_id)
        except OSError as err:
            log.warning("cannot close FUSE backing id %d: %s", backing_id, err.strerror)

    def read(self, nodeid: int, n: int) -> bytes | memoryview:
        _, offset, size, _ = fw.READ_IN.unpack_from(self._buf, HEADER)
        return self.tree.read(nodeid, offset, size)

    def write(self, nodeid: int, n: int) -> bytes:
        _, offset, size, _, _, _, _ = fw.WRITE_IN.unpack_from(self._buf, HEADER)
        start = HEADER + fw.WRITE_IN.size
        written = self.ns.write_ckpt(nodeid, offset, self._view[start:start + size],
                                     self.caller)
        return fw.WRITE_OUT.pack(written, 0)

    def release(self, nodeid: int, n: int) -> None:
        """The kernel closed an open (dlfsd.ckpt.opens decides what that means)."""
        fh, flags, _ = fw.RELEASE_IN.unpack_from(self._buf, HEADER)
        writing = bool(flags & WRITE_FLAGS)
        passed = self.opens.released(nodeid, bool(fh & 1), writing, self._unregister)
        if passed and writing:  # counted at its open (fh bit 0, see _open_reply)
            self._count_passthrough_write(nodeid, fh >> 32, fh >> 1 & 0x7FFFFFFF)

    def _count_passthrough_write(self, nodeid: int, pid: int, opened_s: int) -> None:
        """The daemon saw none of the writes: a file changed since it was opened counts
        with its size, once, at its close (docs/CKPT.md, "Visibility")."""
        try:
            attr = self.tree.getattr(nodeid)
        except Exception:  # removed meanwhile
            return
        changed = (attr.mtime_ns // 1_000_000_000 & 0x7FFFFFFF) >= opened_s
        if changed and stat.S_ISREG(attr.mode):
            self.caller.pid = pid
            self.ns.count_ckpt_write(nodeid, attr.size, self.caller)

    def fsync(self, nodeid: int, n: int) -> None:
        _, fsync_flags, _ = fw.FSYNC_IN.unpack_from(self._buf, HEADER)
        self.tree.fsync(self._node(nodeid), bool(fsync_flags & fw.FSYNC_FDATASYNC))

    def fallocate(self, nodeid: int, n: int) -> None:
        _, offset, length, mode, _ = fw.FALLOCATE_IN.unpack_from(self._buf, HEADER)
        self.tree.fallocate(nodeid, offset, length, mode)

    # -- directories -------------------------------------------------------------------------
    def opendir(self, nodeid: int, n: int) -> bytes:
        if not stat.S_ISDIR(self.tree.getattr(self._node(nodeid)).mode):
            raise Errno(errno.ENOTDIR)
        return fw.OPEN_OUT.pack(0, 0, 0)  # listings change: the kernel must not keep them

    def readdir(self, nodeid: int, n: int) -> bytes:
        return self._listing(nodeid, False)

    def readdirplus(self, nodeid: int, n: int) -> bytes:
        return self._listing(nodeid, True)

    def _listing(self, nodeid: int, plus: bool) -> bytes:
        _, offset, size, _ = fw.READ_IN.unpack_from(self._buf, HEADER)
        return pack_entries(self.tree.readdir(self._node(nodeid), offset), size,
                            self.attrs.entry if plus else None)

    def empty(self, nodeid: int, n: int) -> None:
        return None

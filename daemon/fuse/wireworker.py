"""WireWorker: a forked worker process serving FUSE requests straight off /dev/fuse.

Why not pyfuse3 here: a request through pyfuse3's trio loop costs about 40 µs
of CPU (epoll registration, a trio task switch, a lock, coroutine wrappers);
the same request read and answered here with one blocking read() and one
write() costs about 25 µs, most of it the kernel's own round trip. A blocking
read() of /dev/fuse also wakes exactly one waiting worker per request, where
epoll wakes them all. And only here can the kernel open files without us
(FUSE no_open, the default; see `open`): READ then carries no handle, and
pyfuse3's read() is not given the inode, so it could not serve it. A file
already in the page cache then costs the daemon no request at all. The same
goes for directories (FUSE no_opendir, see `opendir`). The checkpoint directory,
which needs every open, is a connection of its own (dlfsd.fuse.ckptworker).

The main process mounts and answers INIT itself (which negotiates the protocol,
dlfsd.fuse.session) and nothing else; workers are forked after that and only
translate: each request becomes one Namespace call,
each failure an errno through one table (dlfsd.fuse.errnomap). One request at a
time per process, its blocking I/O inline (the libfuse multi-thread model).
"""

from __future__ import annotations

import errno
import logging
import os

from dlfsd.base.kernel import kernel_skips_opens, workers_answer_opens
from dlfsd.core.passthrough import PassthroughOpens
from dlfsd.core.values import DatasetCalls, FileSpan
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse.errnomap import errno_for
from dlfsd.fuse.listing import ListingPacker, pack_entries
from dlfsd.fuse.requestloop import HEADER as _HEADER
from dlfsd.fuse.requestloop import (
    WORKER_ABORTED,
    Caller,
    Errno,
    RequestLoop,
    find_fuse_fd,
    fuse_fds,
)
from dlfsd.fuse.splicer import ReplySplicer, SpliceFailed

log = logging.getLogger(__name__)

__all__ = ["WORKER_ABORTED", "Caller", "WireWorker", "find_fuse_fd", "fuse_fds"]


class WireWorker(RequestLoop):
    """Serves the datasets' requests from `fd` until unmount (ENODEV) or SIGTERM."""

    def __init__(self, namespace: DatasetCalls, fd: int, uid: int, gid: int,
                 cache_timeout: float, count_opens: bool = False, pipe_size: int = 0,
                 passthrough: PassthroughOpens | None = None) -> None:
        """`passthrough`: the mount serves large files by FUSE passthrough (the kernel
        granted it): every OPEN is answered, a large file's with its backing id."""
        super().__init__(fd)
        self.ns = namespace
        self.passthrough = passthrough
        self.answer_opens = workers_answer_opens(count_opens) or passthrough is not None
        self._opened = 0  # the large file the OPEN being answered counted (_reply_lost)
        self._register_warned = False
        self.no_opendir = kernel_skips_opens()[1]
        self.attrs = fw.AttrPacker(uid, gid, cache_timeout)
        # `.dlfs/` files change all the time: the kernel must ask again on each read.
        self.control_attrs = fw.AttrPacker(uid, gid, 0.0)
        self._listers: dict[int, ListingPacker] = {}  # by the inode of the dataset's row 0
        # pipe_size: for spliced read replies (dlfsd.fuse.splicer.usable_pipe_size); 0: copy.
        self.splicer = ReplySplicer(fd, pipe_size) if pipe_size else None
        if self.splicer is not None:  # kept for _send_span: spans come only with it
            self._splicer = self.splicer
        self._splice_warned = False
        self._use_spans(True)
        self._handlers = {
            fw.LOOKUP: self.lookup, fw.GETATTR: self.getattr, fw.READLINK: self.readlink,
            fw.OPEN: self.open, fw.READ: self.read, fw.RELEASE: self.release,
            fw.STATFS: self.statfs, fw.GETXATTR: self.getxattr, fw.LISTXATTR: self.listxattr,
            fw.OPENDIR: self.opendir, fw.READDIR: self.readdir,
            fw.READDIRPLUS: self.readdirplus, fw.RELEASEDIR: self.empty,
            fw.ACCESS: self.access, fw.DESTROY: self.empty,
        }
        for opcode, name in fw.MUTATING.items():  # the core refuses them all (EROFS)
            self._handlers[opcode] = self._refusal(name)

    def _use_spans(self, on: bool) -> None:
        """Let large reads of verified bytes come back as spans we splice (dlfsd.fuse.splicer)."""
        capacity = self.splicer.capacity if self.splicer is not None and on else 0
        self.ns.use_spans(capacity)

    def _send_span(self, unique: int, span: FileSpan, nodeid: int, n: int) -> None:
        try:
            self._splicer.send(fw.reply_header(unique, span.length), span.fd, span.pos,
                              span.length)
            return
        except (SpliceFailed, OSError) as err:  # OSError: no new pipe (out of descriptors)
            if not self._splice_warned:
                self._splice_warned = True
                log.warning("worker %d: cannot splice a read reply (%s); reading it again "
                            "the copying way", os.getpid(), err)
        # Read again without spans: a staged copy that fails now is evicted and the
        # read served from elsewhere, a corrupt store copy answers EIO. (The read's
        # counters then count it twice: a rare failure path.)
        self._use_spans(False)
        try:
            payload = self.read(nodeid, n)
        except Exception as err:
            self._send(fw.error_reply(unique, errno_for(err, "read")))
            return
        finally:
            self._use_spans(True)
        self._send(fw.reply_header(unique, len(payload)), payload)

    # -- requests: each returns the reply payload (None: empty success) ---------------
    def _packer(self, ino: int) -> fw.AttrPacker:
        return self.control_attrs if self.ns.is_control(ino) else self.attrs

    def _attr(self, ino: int, caller: Caller | None):
        """Attributes of `ino`; `caller` is traced (None: part of another request)."""
        if self.answer_opens or not self.ns.is_control(ino):
            return self.ns.getattr(ino, caller)
        # A `.dlfs/` file the kernel will open without us: its size is that of the
        # snapshot this process will read (see ControlFiles.latest_attr).
        return self.ns.control_attr(ino, self.caller.pid)

    def lookup(self, nodeid: int, n: int) -> bytes:
        ino = self.ns.lookup(nodeid, self._name_arg(n), self.caller)
        return self._packer(ino).entry(self._attr(ino, None))

    def getattr(self, nodeid: int, n: int) -> bytes:
        return self._packer(nodeid).attr(self._attr(nodeid, self.caller))

    def readlink(self, nodeid: int, n: int) -> bytes:
        return self.ns.readlink(nodeid)

    def open(self, nodeid: int, n: int) -> bytes:
        flags, _ = fw.OPEN_IN.unpack_from(self._buf, _HEADER)
        self.ns.check_open(nodeid, flags)
        if not self.answer_opens:
            # FUSE no_open: from this reply on the kernel opens and closes files
            # itself (keeping their page cache) and reads arrive with handle 0.
            raise Errno(errno.ENOSYS)
        self._opened = 0
        fh, direct_io = self.ns.open(nodeid, self.caller)
        if self.passthrough is not None:
            backing = self.passthrough.opened(nodeid, self._register)
            if backing >= 0:  # a large file: counted until its RELEASE
                self._opened = nodeid
            if backing > 0:  # the kernel reads the verified whole-file copy itself
                return fw.OPEN_OUT.pack(fh, fw.FOPEN_PASSTHROUGH, backing)
        return fw.OPEN_OUT.pack(fh, fw.FOPEN_DIRECT_IO if direct_io else fw.FOPEN_KEEP_CACHE, 0)

    def _register(self, fd: int) -> int:
        """A backing id for the copy open as `fd`; 0 (served here) if the kernel refuses
        (logged once per process)."""
        try:
            return fw.open_backing(self.fd, fd)
        except OSError as err:
            if not self._register_warned:
                self._register_warned = True
                log.warning("worker %d: FUSE passthrough refused for a large file's copy "
                            "(%s); such files are served by the daemon", os.getpid(),
                            err.strerror)
            return 0

    def _unregister(self, backing_id: int) -> None:
        try:
            fw.close_backing(self.fd, backing_id)
        except OSError as err:
            log.warning("cannot close FUSE backing id %d: %s", backing_id, err.strerror)

    def _reply_lost(self, opcode: int) -> None:
        """The opener was interrupted before our answer to OPEN arrived: no RELEASE will
        come, so a large file's open must not stay counted."""
        if opcode == fw.OPEN and self._opened and self.passthrough is not None:
            self.passthrough.released(self._opened, self._unregister)
            self._opened = 0

    def read(self, nodeid: int, n: int):
        fh, offset, size, _ = fw.READ_IN.unpack_from(self._buf, _HEADER)
        if fh == 0:  # opened by the kernel alone (no_open)
            return self.ns.read_inode(nodeid, offset, size, self.caller)
        return self.ns.read(fh, offset, size)

    def release(self, nodeid: int, n: int) -> None:
        fh, _, _ = fw.RELEASE_IN.unpack_from(self._buf, _HEADER)
        if self.passthrough is not None:
            self.passthrough.released(nodeid, self._unregister)
        self.ns.release(fh)

    def statfs(self, nodeid: int, n: int) -> bytes:
        return fw.statfs(self.ns.statfs())

    def getxattr(self, nodeid: int, n: int) -> bytes:
        return self.ns.getxattr(nodeid, self._name_arg(n, _HEADER + fw.SIZE_IN.size))

    def listxattr(self, nodeid: int, n: int) -> bytes:
        names = b"".join(name + b"\0" for name in self.ns.listxattr(nodeid))
        size, _ = fw.SIZE_IN.unpack_from(self._buf, _HEADER)
        if size == 0:  # the caller asks how large a buffer it needs
            return fw.XATTR_SIZE_OUT.pack(len(names), 0)
        return names

    def opendir(self, nodeid: int, n: int) -> bytes:
        # FUSE no_opendir: from this reply on the kernel opens and closes directories
        # itself, one round trip less per directory listed (and no RELEASEDIR), and
        # treats them as opened with FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE: listings never
        # change, so it keeps them, and a second walk of the tree costs no request.
        # Listing requests then name the directory by its inode only (handle 0).
        if self.no_opendir:
            raise Errno(errno.ENOSYS)
        self.ns.check_dir(nodeid)  # ENOTDIR for a file, ENOENT for an unknown inode
        return fw.OPEN_OUT.pack(0, fw.FOPEN_KEEP_CACHE | fw.FOPEN_CACHE_DIR, 0)

    def readdir(self, nodeid: int, n: int) -> bytes:
        return self._listing(nodeid, False)

    def readdirplus(self, nodeid: int, n: int) -> bytes:
        return self._listing(nodeid, True)

    def _listing(self, nodeid: int, plus: bool) -> bytes:
        """Directory entries from the request's offset while they fit its size; with
        `plus` (READDIRPLUS) each carries the entry's attributes too."""
        _, offset, size, _ = fw.READ_IN.unpack_from(self._buf, _HEADER)
        found = self.ns.dataset_directory(nodeid)
        if found is not None:  # a dataset directory: packed in bulk
            directory, base, row = found
            lister = self._listers.get(base)
            if lister is None:
                lister = self._listers[base] = ListingPacker(directory, base, self.attrs)
            return lister.pack(row, offset, size, plus)
        # the root and `.dlfs/`: a few entries
        return pack_entries(self.ns.readdir(nodeid, offset), size,
                            (lambda attr: self._packer(attr.ino).entry(attr)) if plus else None)

    def access(self, nodeid: int, n: int) -> None:
        mask, _ = fw.ACCESS_IN.unpack_from(self._buf, _HEADER)
        self.ns.check_access(nodeid, mask)

    def empty(self, nodeid: int, n: int) -> None:
        return None

    def _refusal(self, name: str):
        def refuse(nodeid: int, n: int) -> None:
            self.ns.refuse_change(name)

        return refuse

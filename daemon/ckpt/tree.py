"""CkptTree: the writable `MOUNTPOINT/ckpt/` subtree, a passthrough onto the tier's
local directory (POSIX create/write/read/rename/unlink/mkdir/rmdir/readdir/truncate/
fsync/stat), addressed by FUSE node ids.

Why a passthrough onto a real directory: the FUSE requests of one file reach any of
the forked worker processes, so whatever the tree is must be shared by all of them;
the local directory already is, and its bytes are written at the cache disk's speed.

Node ids: CKPT_BIT | st_ino of the backing entry. The top bit keeps them apart from
the mount root, `.dlfs/` and dataset inodes (all far below 2**63), so the read path
tells a checkpoint node from a dataset one with one comparison. An inode number is
stable across renames, so the kernel's node id stays right when an entry (or a
directory above it) is renamed. Any process finds the path of a node id through
dlfsd.ckpt.state's `nodes` table (parent inode, name), written at every lookup,
create and rename; each process caches the path and checks it with the lstat it
needs anyway (the inode must match), walking the table again only after a rename.

Descriptors: each process keeps its own descriptor per written/read node id
(no handle can name a descriptor of another process); all are closed when any
process removes or replaces an entry (Tier.epoch), since the inode number may
then be reused by a new file.

Drain bookkeeping: a write marks the file pending (at most once a second per file
and process); the close of a file the daemon opened (RELEASE) marks it closed.
dlfsd.ckpt.drain does the rest.

The store's entries (restart on another node): `ckpt/` shows the union of the local
tree and the checkpoint store; which version of a name it shows is decided by
dlfsd.ckpt.union (adoption of the store's entries, copies that follow the store, the
store-side mirror of mkdir, symlink, rename, unlink, rmdir). Every operation goes
through tier.local / tier.store_fs (dlfsd.ckpt.beneath): by descriptors, never
through a symlink, as the job's user.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections import OrderedDict

from dlfs.errors import DlfsError
from dlfsd.base.nodeids import CKPT_BIT
from dlfsd.ckpt import sums
from dlfsd.ckpt.state import same_file
from dlfsd.ckpt.tier import Tier, is_adopt_temporary
from dlfsd.ckpt.union import (
    StoreUnion,
    hidden,
    remove_on_store,
    rename_on_store,
    rmdir_on_store,
    store_holds_entries,
    symlink_on_store,
)
from dlfsd.core.values import Attr, StatFs

OPEN_FDS = 128  # descriptors kept per process
TOUCH_EVERY_NS = 1_000_000_000  # a written file's pending row is refreshed this often
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2

log = logging.getLogger("dlfsd")


class PosixError(DlfsError):
    """An expected failure of a checkpoint request, answered with its errno (not
    logged: ENOENT from a lookup is how a program asks whether a file exists)."""

    def __init__(self, code: int, what: str = "") -> None:
        super().__init__(f"{os.strerror(code)}: {what}")
        self.errno = code


def _attr(ino: int, st: os.stat_result) -> Attr:
    return Attr(CKPT_BIT | ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_nlink)


def _checked_name(name: bytes) -> bytes:
    """A name of one entry, not one of the tier's hidden temporaries (reserved: the
    store's are never shown, the local ones are removed at the next mount)."""
    if not name or b"/" in name or name in (b".", b"..") or hidden(name):
        raise PosixError(errno.EINVAL, repr(name))
    return name


class CkptTree:
    """The checkpoint subtree's POSIX operations, by node id (any process)."""

    def __init__(self, tier: Tier, written=None, limit_wait: float = 60.0,
                 open_files=None) -> None:
        """`written`: dlfsd.ckpt.counters.WriteCounter; `limit_wait`: seconds a write
        waits for room under --ckpt-limit before ENOSPC; `open_files`: the mount's
        dlfsd.ckpt.openfiles.OpenFiles (the union never replaces a file being written;
        None: a tree of the drain's or a test's, which opens nothing)."""
        self.tier = tier
        self.limit_wait = limit_wait
        self._from_store: set[int] = set()  # inodes whose kept descriptor is the store's
        # Of those, the ones whose store copy has sums (dlfsd.ckpt.sums): checked reads
        self._checks: dict[int, sums.ExtentCheck] = {}
        self._checked_reads = sums.CheckedReads()
        self.state = tier.state
        self.root_nodeid = CKPT_BIT | tier.root_ino
        self.written = written
        self._paths: dict[int, bytes] = {tier.root_ino: b""}  # ino -> path in the tree
        self.local = tier.local  # the local tree (dlfsd.ckpt.beneath), as the job's user
        self.store = tier.store_fs  # the checkpoint store, the same way
        self._fds: OrderedDict[int, int] = OrderedDict()  # ino -> descriptor
        self._epoch = tier.current_epoch()
        self._touched: dict[int, int] = {}  # ino -> when its pending row was refreshed
        #: Which version of each name ckpt/ shows (dlfsd.ckpt.union): it decides
        self.union = StoreUnion(tier, self._paths, self._drop_fd, open_files)

    # -- node ids -> paths ------------------------------------------------------------
    def _resolve(self, nodeid: int) -> tuple[bytes, os.stat_result]:
        ino = nodeid & ~CKPT_BIT
        path = self._paths.get(ino)
        if path is not None:
            try:
                st = self.local.lstat(path)
                if st.st_ino == ino:
                    return path, st
            except OSError:
                pass
        path = self._walk(ino)
        try:
            st = self.local.lstat(path)
        except OSError as err:
            raise PosixError(err.errno or errno.ENOENT, "checkpoint entry gone") from None
        if st.st_ino != ino:
            raise PosixError(errno.ENOENT, "checkpoint entry gone")
        self._paths[ino] = path
        return path, st

    def _walk(self, ino: int) -> bytes:
        parts: list[bytes] = []
        root = self.tier.root_ino
        current = ino
        for _ in range(4096):
            if current == root:
                return b"/".join(reversed(parts))
            where = self.state.where(current)
            if where is None:
                break
            current, name = where
            parts.append(name)
        raise PosixError(errno.ENOENT, f"checkpoint inode {ino} unknown")

    def path_of(self, nodeid: int) -> bytes:
        """The node's path relative to the tree's root."""
        return self._resolve(nodeid)[0]

    def forget_path(self, ino: int) -> None:
        """`ino` was renamed behind this cache's back (the drain's conflict name)."""
        self._paths.pop(ino, None)

    def _dir(self, nodeid: int) -> bytes:
        path, st = self._resolve(nodeid)
        if not stat.S_ISDIR(st.st_mode):
            raise PosixError(errno.ENOTDIR)
        return path

    def _child(self, parent: int, name: bytes) -> tuple[bytes, bytes]:
        """(path of the parent directory, path of its entry `name`)."""
        directory = self._dir(parent)
        return directory, os.path.join(directory, _checked_name(name))

    def _learn(self, parent: int, parent_path: bytes, name: bytes,
               st: os.stat_result) -> Attr:
        """Record entry `name` of directory node `parent` (so any process finds it): a
        read first, a write only if the row differs (a lookup of a known entry then
        commits nothing to the database)."""
        if self.state.where(st.st_ino) != (parent & ~CKPT_BIT, name):
            self.state.remember(st.st_ino, parent & ~CKPT_BIT, name)
        self._paths[st.st_ino] = os.path.join(parent_path, name)
        return _attr(st.st_ino, st)

    # -- descriptors -------------------------------------------------------------------
    def _fd(self, nodeid: int, writing: bool) -> int:
        epoch = self.tier.current_epoch()
        if epoch != self._epoch:
            self._close_all()
            self._epoch = epoch
        ino = nodeid & ~CKPT_BIT
        fd = self._fds.get(ino)
        if fd is not None and not (writing and ino in self._from_store):
            self._fds.move_to_end(ino)
            return fd
        path, st = self._resolve(nodeid)
        if not stat.S_ISREG(st.st_mode):
            raise PosixError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL)
        if self.state.is_evicted(ino):
            if not writing:  # served from the store's copy (the local one is a hole)
                fd, check = self._store_fd(ino)
                self._keep(ino, fd, check)
                self._from_store.add(ino)
                return fd
            self._restore(ino, path)
        self._from_store.discard(ino)
        try:
            fd = self.local.open(path, os.O_RDWR)
        except PermissionError:
            if writing:
                raise PosixError(errno.EACCES, "checkpoint file not writable") from None
            fd = self.local.open(path, os.O_RDONLY)
        self._keep(ino, fd)
        return fd

    def _store_fd(self, ino: int, check: bool = True) -> tuple[int, sums.ExtentCheck | None]:
        """A descriptor of the store's copy of evicted file `ino` and the copy's sums
        (None: it has none, read unchecked); with `check`, of the copy this node saw
        (ESTALE if another node's has replaced it since: a read must never mix
        versions, nor read a new one under the old one's size)."""
        row = self.state.tracking(ino)
        if row is None:
            raise PosixError(errno.EIO, "evicted checkpoint file without a store copy")
        try:
            fd = self.store.open(row.relpath, os.O_RDONLY)
        except FileNotFoundError:  # removed on the store (by another node)
            raise PosixError(errno.ESTALE, "the store's copy is gone") from None
        except OSError as err:
            raise PosixError(errno.EIO, f"the store's copy of an evicted checkpoint file: "
                                        f"{err.strerror}") from None
        try:
            st = os.fstat(fd)
            if check and row.seen is not None and not same_file(st, row.seen):
                raise PosixError(errno.ESTALE, "the store's copy was replaced")
            # The sums of the very copy this descriptor reads (its fstat names them)
            return fd, sums.load(self.store, st, os.fsdecode(row.relpath),
                                 self.tier.checked_bytes)
        except BaseException:
            os.close(fd)
            raise

    def _restore(self, ino: int, path: bytes) -> None:
        """An evicted file is written again: copy the store's bytes back first."""
        with self.tier.mutating():
            if not self.state.is_evicted(ino):
                return  # another process did
            ledger = self.state.ledger().get(ino)
            source, check = self._store_fd(ino, check=False)  # what the store holds now
            try:
                self._copy_back(source, check, path)
            finally:
                os.close(source)
            if ledger is not None:
                self.local.utime(path, (time.time_ns(), ledger[1]))  # still the drained bytes
            self.state.unevict(ino)
            # Pending before the lock goes: to be written, it no longer follows the store
            # (a lookup elsewhere must not replace it by another node's newer copy).
            self._mark_pending(ino)
            self.tier.bump_epoch()

    def _copy_back(self, source: int, check: sums.ExtentCheck | None, path: bytes) -> None:
        """Copy the store's bytes into the placeholder `path`, each extent checked
        against its sums where it has some. A mismatch fails with EIO (CorruptDataError)
        and leaves the placeholder as it was: a hole of its size and times."""
        before = self.local.lstat(path)
        buf = bytearray(sums.EXTENT)
        view = memoryview(buf)
        target = self.local.open(path, os.O_WRONLY)
        try:
            offset = index = 0
            while n := sums.read_full(source, view, offset):
                if check is not None and not check.matches(index, view[:n]):
                    os.ftruncate(target, 0)  # the hole again, as eviction leaves it
                    os.ftruncate(target, before.st_size)
                    self.local.utime(path, (before.st_atime_ns, before.st_mtime_ns))
                    raise self._checked_reads.mismatch(check, index)
                done = 0
                while done < n:
                    done += os.pwrite(target, view[done:n], offset + done)
                offset += n
                index += 1
            os.ftruncate(target, offset)  # another node's copy may be shorter
            os.fsync(target)
        finally:
            os.close(target)

    def _wait_for_room(self) -> None:
        """--ckpt-limit reached: wait for the drain to make room, else ENOSPC."""
        deadline = time.monotonic() + self.limit_wait
        while self.tier.full():
            if time.monotonic() > deadline:
                raise PosixError(errno.ENOSPC, "checkpoint tier full (--ckpt-limit)")
            time.sleep(0.05)

    def _keep(self, ino: int, fd: int, check: sums.ExtentCheck | None = None) -> None:
        """Keep `fd` as this process's descriptor of `ino` (with the sums of the store
        copy it reads, if any: they go with the descriptor)."""
        old = self._fds.pop(ino, None)
        if old is not None and old != fd:
            os.close(old)
        self._fds[ino] = fd
        if check is None:
            self._checks.pop(ino, None)
        else:
            self._checks[ino] = check
        while len(self._fds) > OPEN_FDS:
            gone, old = self._fds.popitem(last=False)
            os.close(old)
            self._checks.pop(gone, None)
            self._from_store.discard(gone)

    def _close_all(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._from_store.clear()
        self._checks.clear()

    def _drop_fd(self, ino: int) -> None:
        self._from_store.discard(ino)
        self._checks.pop(ino, None)
        fd = self._fds.pop(ino, None)
        if fd is not None:
            os.close(fd)

    def _mark_pending(self, ino: int) -> None:
        """Pending now, whatever `_touch`'s once-a-second rule says."""
        self._touched[ino] = time.monotonic_ns()
        self.state.touch(ino)

    def _touch(self, ino: int) -> None:
        now = time.monotonic_ns()
        if now - self._touched.get(ino, -TOUCH_EVERY_NS) >= TOUCH_EVERY_NS:
            self._touched[ino] = now
            self.state.touch(ino)

    # -- metadata ----------------------------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> Attr:
        """The local entry, else the store's (adopted). Costs one lstat on the store
        when the name is missing here, or is a file or symlink that is only a copy of
        the store's (to follow it); none for a directory or a file written here."""
        directory, path = self._child(parent, name)
        try:
            st = self.local.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError as err:
            raise PosixError(err.errno or errno.ENOENT, "lookup") from None
        if st is None or not stat.S_ISDIR(st.st_mode):
            try:
                st = self.union.beside(parent, directory, name, st)
            except OSError as err:
                raise PosixError(err.errno or errno.EIO, "checkpoint entry from the store") \
                    from None
            if st is None:
                raise PosixError(errno.ENOENT, "lookup")
        return self._learn(parent, directory, name, st)

    def getattr(self, nodeid: int) -> Attr:
        _path, st = self._resolve(nodeid)
        return _attr(st.st_ino, st)

    def setattr(self, nodeid: int, mode: int | None = None, size: int | None = None,
                atime_ns: int | None = None, mtime_ns: int | None = None,
                now_atime: bool = False, now_mtime: bool = False) -> Attr:
        """chmod, truncate, utimens of a checkpoint entry (owners are the mount's). A
        symlink's mode and size are refused (EPERM, EINVAL): they would be its target's;
        its times are set on the link itself."""
        path, st = self._resolve(nodeid)
        ino = st.st_ino
        if stat.S_ISLNK(st.st_mode) and (mode is not None or size is not None):
            raise PosixError(errno.EPERM if mode is not None else errno.EINVAL,
                             "chmod or truncate of a symlink")
        try:
            if mode is not None:
                self.local.chmod(path, stat.S_IMODE(mode))
            if size is not None:
                if not stat.S_ISREG(st.st_mode):
                    raise PosixError(errno.EISDIR)
                if self.state.is_evicted(ino):
                    self._restore(ino, path)
                self.local.truncate(path, size)
                self._touch(ino)
            if atime_ns is not None or mtime_ns is not None or now_atime or now_mtime:
                now = time.time_ns()
                atime = now if now_atime else (atime_ns if atime_ns is not None
                                                else st.st_atime_ns)
                mtime = now if now_mtime else (mtime_ns if mtime_ns is not None
                                                else st.st_mtime_ns)
                self.local.utime(path, (atime, mtime))
            st = self.local.lstat(path)
        except OSError as err:
            raise PosixError(err.errno or errno.EIO, "setattr") from None
        return _attr(ino, st)

    def readlink(self, nodeid: int) -> bytes:
        return self.local.readlink(self._resolve(nodeid)[0])

    def readdir(self, nodeid: int, start: int):
        """(name, Attr, next offset) from offset `start` (names sorted: stable offsets).
        Every entry is recorded before any is handed out: READDIRPLUS makes the kernel
        know each as a node, and its next request may reach another process. A listing
        from its start merges the store's directory in first (_merge_store)."""
        directory = self._dir(nodeid)
        if start == 0:
            self.union.merge(nodeid, directory)
        parent_ino = nodeid & ~CKPT_BIT
        entries, learned = [], []
        listing = self.local.entries(directory)
        names = sorted(n for n in listing if not is_adopt_temporary(n))
        for offset, name in enumerate(names[start:], start + 1):
            path = os.path.join(directory, name)
            st = listing[name]
            learned.append((st.st_ino, parent_ino, name))
            self._paths[st.st_ino] = path
            entries.append((name, _attr(st.st_ino, st), offset))
        self.state.remember_many(learned)
        return iter(entries)

    def statfs(self) -> StatFs:
        s = self.local.statvfs()
        return StatFs(blocks=s.f_blocks * s.f_frsize // 4096, files=s.f_files,
                      bfree=s.f_bfree * s.f_frsize // 4096,
                      bavail=s.f_bavail * s.f_frsize // 4096, ffree=s.f_ffree)

    # -- entries -------------------------------------------------------------------------
    def create(self, parent: int, name: bytes, flags: int, mode: int) -> Attr:
        """Create (or open, without O_EXCL) a regular file; it is pending at once (an
        empty checkpoint file is a file too)."""
        directory, path = self._child(parent, name)
        flags = (flags & (os.O_EXCL | os.O_TRUNC)) | os.O_CREAT | os.O_RDWR | os.O_CLOEXEC
        try:
            fd = self.local.open(path, flags, stat.S_IMODE(mode) or 0o644)
            st = os.fstat(fd)
        except OSError as err:
            raise PosixError(err.errno or errno.EIO, "create") from None
        attr = self._learn(parent, directory, name, st)
        if self.state.is_evicted(st.st_ino):  # an existing file whose copy was evicted
            os.close(fd)
            if flags & os.O_TRUNC:
                self._unevict_truncated(attr.ino)
            else:
                self._restore(st.st_ino, path)
            fd = self.local.open(path, os.O_RDWR)
        self._keep(st.st_ino, fd)
        self._touch(st.st_ino)
        return attr

    def mknod(self, parent: int, name: bytes, mode: int) -> Attr:
        if not stat.S_ISREG(mode):
            raise PosixError(errno.EPERM, "only regular files, directories and symlinks")
        attr = self.create(parent, name, os.O_EXCL, mode)
        self._drop_fd(attr.ino & ~CKPT_BIT)
        return attr

    def mkdir(self, parent: int, name: bytes, mode: int) -> Attr:
        """A directory here and (one mkdir) on the store: an empty directory is part of
        a checkpoint too, and another node sees it."""
        directory, path = self._child(parent, name)
        with self.tier.mutating():
            try:
                self.local.mkdir(path, stat.S_IMODE(mode) or 0o755)
                st = self.local.lstat(path)
            except OSError as err:
                raise PosixError(err.errno or errno.EIO, "mkdir") from None
            attr = self._learn(parent, directory, name, st)
            relpath = path
            try:
                self.tier.makedirs_on_store(relpath)
            except OSError as err:
                self.union.trouble("mkdir", err, f"checkpoint directory {os.fsdecode(relpath)} "
                                    "made here but not on the store; it appears there when "
                                    "a file in it is drained")
                return attr
            self.state.adopt(st.st_ino, parent & ~CKPT_BIT, name, st.st_size,
                             st.st_mtime_ns, relpath, False, None)
        return attr

    def symlink(self, parent: int, name: bytes, target: bytes) -> Attr:
        """A symlink here and on the store (made under a hidden name and renamed into
        place, like a drained file): a `latest` link is how a restart finds its step."""
        directory, path = self._child(parent, name)
        with self.tier.mutating():
            try:
                self.local.symlink(target, path)
                st = self.local.lstat(path)
            except OSError as err:
                raise PosixError(err.errno or errno.EIO, "symlink") from None
            attr = self._learn(parent, directory, name, st)
            relpath = path
            try:
                seen = symlink_on_store(self.tier, relpath, target)
            except OSError as err:
                self.union.trouble("symlink", err, f"checkpoint symlink "
                                    f"{os.fsdecode(relpath)} made here but not on the store")
                return attr
            self.state.adopt(st.st_ino, parent & ~CKPT_BIT, name, st.st_size,
                             st.st_mtime_ns, relpath, False, seen)
        return attr

    def unlink(self, parent: int, name: bytes) -> None:
        self._remove(parent, name, directory=False)

    def rmdir(self, parent: int, name: bytes) -> None:
        self._remove(parent, name, directory=True)

    def _remove(self, parent: int, name: bytes, directory: bool) -> None:
        """Remove the local entry and, where the drain put it on the store, the store's
        copy too: the store mirrors the tree (a program deleting old checkpoints means
        the store's)."""
        _, path = self._child(parent, name)
        relpath = path
        with self.tier.mutating():
            try:
                st = self.local.lstat(path)
                if directory:
                    # The store's directory first: one holding entries this node has not
                    # adopted yet is not empty in `ckpt/` either (ENOTEMPTY, nothing done).
                    if stat.S_ISDIR(st.st_mode) and not self.local.listdir(path):
                        rmdir_on_store(self.tier, relpath)
                    self.local.rmdir(path)
                else:
                    self.local.unlink(path)
            except OSError as err:
                raise PosixError(err.errno or errno.EIO, "remove") from None
            self.tier.bump_epoch()
            self._drop_fd(st.st_ino)
            if not directory and self.state.drained_at(st.st_ino) == relpath:
                remove_on_store(self.tier, relpath, directory)
            if directory or st.st_nlink <= 1:
                self.state.forget(st.st_ino)

    def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        """Rename locally; what the store holds under the old name moves with it (one
        rename on the store), so a checkpoint written then renamed into place is not
        copied twice."""
        _old_dir, old = self._child(parent, name)
        _, new = self._child(new_parent, new_name)
        with self.tier.mutating():
            try:
                st = self.local.lstat(old)
                replaced = self.local.lstat_or_none(new)
                if flags & RENAME_EXCHANGE:
                    raise PosixError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
                if flags & RENAME_NOREPLACE and replaced is not None:
                    raise PosixError(errno.EEXIST, "rename")
                if replaced is not None and stat.S_ISDIR(replaced.st_mode) \
                        and store_holds_entries(self.tier, new):
                    raise PosixError(errno.ENOTEMPTY, "rename over a directory the "
                                                      "checkpoint store holds entries in")
                self.local.rename(old, new)
            except OSError as err:
                raise PosixError(err.errno or errno.EIO, "rename") from None
            if replaced is not None:
                self.tier.bump_epoch()
                if not stat.S_ISDIR(replaced.st_mode) and replaced.st_nlink <= 1:
                    self.state.forget(replaced.st_ino)
            self.state.remember(st.st_ino, new_parent & ~CKPT_BIT, new_name)
            self._paths[st.st_ino] = new
            old_rel, new_rel = old, new
            moved = rename_on_store(self.tier, old_rel, new_rel)
            if moved is not False:
                self.state.moved(old_rel, new_rel)
                if moved is not None:  # a rename changes the copy's ctime: seen anew
                    self.state.reseen(st.st_ino, moved)

    # -- data ----------------------------------------------------------------------------
    def open(self, nodeid: int, flags: int) -> None:
        """An open the daemon answers: O_TRUNC is done here (the kernel leaves it to us)."""
        writing = bool(flags & (os.O_WRONLY | os.O_RDWR))
        if writing:
            if flags & os.O_TRUNC:
                self._unevict_truncated(nodeid)
            if not self.state.is_evicted(nodeid & ~CKPT_BIT):  # else _restore does it
                # Pending from the open on: a file about to be written no longer
                # follows the store (a lookup elsewhere must not replace it by another
                # node's copy).
                self._mark_pending(nodeid & ~CKPT_BIT)
        else:
            self._check_current(nodeid)
        fd = self._fd(nodeid, writing=writing)
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
            self._touch(nodeid & ~CKPT_BIT)

    def _check_current(self, nodeid: int) -> None:
        """A read-only open of a copy of the store's file (placeholder, or drained and
        unchanged) whose store copy changed or went since this node looked: ESTALE,
        upon which the kernel looks the path up again (LOOKUP_REVAL: our lookup then
        adopts the new version under a new inode) and opens that. Without it an open
        within the kernel's entry timeout would get the old version."""
        path, st = self._resolve(nodeid)
        if stat.S_ISREG(st.st_mode) and self.union.changed_since_seen(path, st):
            raise PosixError(errno.ESTALE, "the store's copy changed")

    def _unevict_truncated(self, nodeid: int) -> None:
        """An evicted file opened with O_TRUNC: nothing to copy back."""
        path, st = self._resolve(nodeid)
        if self.state.is_evicted(st.st_ino):
            with self.tier.mutating():
                self.local.truncate(path, 0)
                self.state.unevict(st.st_ino)
                self._mark_pending(st.st_ino)
                self.tier.bump_epoch()

    def read(self, nodeid: int, offset: int, size: int) -> bytes | memoryview:
        """Bytes of the local copy; of a placeholder, of the store's copy, checked
        extent by extent where the drain left sums (dlfsd.ckpt.sums): a mismatch is
        EIO for the reads touching that extent."""
        fd = self._fd(nodeid, writing=False)
        check = self._checks.get(nodeid & ~CKPT_BIT)
        if check is None:
            return os.pread(fd, size, offset)
        return self._checked_reads.read(fd, check, offset, size)

    def write(self, nodeid: int, offset: int, data) -> int:
        if self.tier.full():
            self._wait_for_room()
        fd = self._fd(nodeid, writing=True)
        n = os.pwrite(fd, data, offset)
        self._touch(nodeid & ~CKPT_BIT)
        if self.written is not None:
            self.written.add(n)
        return n

    def fsync(self, nodeid: int, datasync: bool) -> None:
        """Durable on this node: the local copy is on the cache disk (docs/CKPT.md)."""
        path, st = self._resolve(nodeid)
        if stat.S_ISDIR(st.st_mode):
            self.local.fsync_dir(path)
            return
        fd = self._fd(nodeid, writing=False)
        os.fdatasync(fd) if datasync else os.fsync(fd)

    def release(self, nodeid: int) -> None:
        """The kernel closed an open of a file: this process's descriptor of it goes (the
        drain is told by `closed`)."""
        ino = nodeid & ~CKPT_BIT
        self._drop_fd(ino)
        self._touched.pop(ino, None)

    def closed(self, ino: int, written: bool) -> None:
        """The last open of file `ino` was closed (`written`: one of them could write):
        drain it now if it was written, by any process and either way (served or
        through passthrough)."""
        if written:
            self.state.closed_after_writing(ino)
        else:
            self.state.closed(ino)

    def fallocate(self, nodeid: int, offset: int, length: int, mode: int) -> None:
        if mode:
            raise PosixError(errno.EOPNOTSUPP, "fallocate mode")
        os.posix_fallocate(self._fd(nodeid, writing=True), offset, length)
        self._touch(nodeid & ~CKPT_BIT)

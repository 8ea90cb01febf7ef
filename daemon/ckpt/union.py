"""StoreUnion: `ckpt/` as the union of the local tree and the checkpoint store, and the
store-side mirror of the tree's name changes (dlfsd.ckpt.tree asks; this decides).

A LOOKUP of a name the local tree lacks, or a READDIR from offset 0, adopts what the
store has there as a local placeholder in the state an eviction leaves (a sparse file
of the store copy's size and mtime, recorded drained and evicted; a directory; a
symlink), so the tree's machinery serves it: reads go to the store's copy, a write
copies it back first, rename and unlink mirror on the store. A local entry that is
only a copy of the store's (a placeholder, or a drained file unchanged since) follows
the store: when the store's copy changes or goes, the local one is replaced or goes
too; a file written here and not drained yet, or open for writing, always wins.

Why a module of its own: which version `ckpt/` shows is one decision with one owner,
testable without a mount; the tree keeps the POSIX operations and its descriptors.
Every operation goes through tier.local / tier.store_fs (dlfsd.ckpt.beneath): by
descriptors, never through a symlink, as the job's user.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable
from typing import Literal, TypeGuard

from dlfsd.base.nodeids import CKPT_BIT
from dlfsd.ckpt import sums
from dlfsd.ckpt.beneath import Beneath
from dlfsd.ckpt.state import Identity, Tracking, identity, same_file
from dlfsd.ckpt.tier import Tier, adopt_name, is_adopt_temporary, is_drain_temporary, tmp_name

log = logging.getLogger("dlfsd")


class StoreUnion:
    """The union's decisions for one process's tree (its path cache and descriptors are
    the tree's: `paths`, `drop_fd`)."""

    def __init__(self, tier: Tier, paths: dict[int, bytes],
                 drop_fd: Callable[[int], None], open_files=None) -> None:
        """`open_files`: the mount's dlfsd.ckpt.openfiles.OpenFiles (None: nothing is
        open through this tree)."""
        self.tier = tier
        self.state = tier.state
        self.local: Beneath = tier.local
        self.store: Beneath = tier.store_fs
        self.paths = paths  # the tree's ino -> path cache, kept right on adoption
        self.drop_fd = drop_fd  # the tree drops its descriptor of a replaced entry
        self.warned: set[str] = set()  # store troubles logged at WARNING (once each)
        self.open_files = open_files

    def beside(self, parent: int, directory: bytes, name: bytes,
                      st: os.stat_result | None) -> os.stat_result | None:
        """Local entry `name` (`st`; None: missing here) as `ckpt/` shows it beside the
        store's: the store's adopted where this node has none, a copy brought up to
        date (or gone) where the store's changed (or went). Returns its stat; None:
        neither has it. The checks cost one lstat on the store, no lock. Raises
        OSError."""
        relpath = os.path.join(directory, name)
        row = None
        if st is not None:
            row = self.state.tracking(st.st_ino)
            if not self.follows(row, st, relpath):
                return st  # written here (or never on the store): it wins
        store_st, ok = self.entry(relpath)
        if not ok:
            return st
        if st is None:
            if store_st is None or not adoptable(name, store_st):
                return None
        elif row is not None and store_st is not None and same_copy(row, st.st_mode, store_st):
            return st
        with self.tier.mutating():
            return self.reconcile(parent, directory, name)

    def follows(self, row: Tracking | None, st: os.stat_result,
                relpath: bytes) -> TypeGuard[Tracking]:
        """Local entry `st` is only a copy of the store's (`is_copy`) and no process has
        it open for writing: the open-files table knows that even when the pending row
        does not (passthrough writes never reach the daemon; a drain of the idle-but-open
        file removed the row). Replacing such a file would leave its writer writing an
        unlinked inode, whose bytes no drain would ever see. True only with a row."""
        if not is_copy(row, st, relpath):
            return False
        return self.open_files is None or not self.open_files.written(st.st_ino)

    def entry(self, relpath: bytes) -> tuple[os.stat_result | None, bool]:
        """(the store's entry at `relpath`, None if there is none; False: the store
        cannot be asked now, and `ckpt/` shows this node's entries alone meanwhile)."""
        try:
            return self.store.lstat(relpath), True
        except (FileNotFoundError, NotADirectoryError):
            return None, True
        except OSError as err:
            if err.errno == errno.ELOOP:
                return None, True  # a symlink on the way: no entry there (none followed)
            self.trouble("read", err, f"checkpoint store {self.tier.store} cannot be "
                                "read; ckpt/ shows this node's files only meanwhile")
            return None, False

    def trouble(self, kind: str, err: OSError, what: str) -> None:
        """Log a store trouble once per kind and process (WARNING), later ones at DEBUG."""
        level = logging.DEBUG if kind in self.warned else logging.WARNING
        self.warned.add(kind)
        log.log(level, "%s (%s)", what, err.strerror or err)

    def reconcile(self, parent: int, directory: bytes, name: bytes) -> os.stat_result | None:
        """Under the tier's mutating lock (which name changes, the drain's publish and
        other adoptions hold too), with everything looked at again: make local entry
        `name` agree with the store's. Returns the local entry's stat (None: none)."""
        path = os.path.join(directory, name)
        relpath = path
        st = self.local.lstat_or_none(path)
        store_st, ok = self.entry(relpath)
        if not ok:
            return st
        if st is not None:
            row = self.state.tracking(st.st_ino)
            if not self.follows(row, st, relpath):
                return st
            if store_st is not None and same_copy(row, st.st_mode, store_st):
                return st
            if store_st is None and not self.tier.store_reachable():
                return st  # a store not mounted looks empty: not a removal
            if store_st is not None and not stat.S_ISDIR(st.st_mode) \
                    and stat.S_IFMT(store_st.st_mode) == stat.S_IFMT(st.st_mode):
                # A new version: its placeholder is made before the old copy goes, so
                # it has another inode number (another node id: nothing the kernel
                # cached, nor a descriptor open on the old one, reads it as the old).
                return self.adopt(parent & ~CKPT_BIT, directory, name, relpath, store_st,
                                   replacing=st)
            self.remove_copy(path, st)  # gone on the store, or another kind now
            st = self.local.lstat_or_none(path)
            if st is not None:
                return st  # a directory still holding this node's own files
        if store_st is None or not adoptable(name, store_st):
            return None
        return self.adopt(parent & ~CKPT_BIT, directory, name, relpath, store_st)

    def adopt(self, parent_ino: int, directory: bytes, name: bytes, relpath: bytes,
               store_st: os.stat_result,
               replacing: os.stat_result | None = None) -> os.stat_result | None:
        """A placeholder of the store's entry at `relpath`: made under a hidden name,
        recorded (drained; a file also evicted), then linked to `name` (or renamed over
        `replacing`, the local copy of an older version). In that order, a crash never
        leaves a named hole the state does not know (the drain would copy it over the
        store's bytes). A directory's entries are adopted when looked up."""
        tmp = os.path.join(directory, adopt_name())
        path = os.path.join(directory, name)
        kind = stat.S_IFMT(store_st.st_mode)
        times = (store_st.st_atime_ns, store_st.st_mtime_ns)
        if kind == stat.S_IFREG:
            fd = self.local.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 stat.S_IMODE(store_st.st_mode))
            try:
                os.ftruncate(fd, store_st.st_size)  # a hole: no local bytes
            finally:
                os.close(fd)
        elif kind == stat.S_IFDIR:
            self.local.mkdir(tmp, stat.S_IMODE(store_st.st_mode) | 0o700)  # we add entries
        else:
            self.local.symlink(self.store.readlink(relpath), tmp)
        self.local.utime(tmp, times)
        st = self.local.lstat(tmp)
        try:
            # Durable before the hole gets its name: a crash must never leave a named
            # hole the ledger does not know (the drain would copy it over the store's).
            self.state.adopt(st.st_ino, parent_ino, name, st.st_size, st.st_mtime_ns, relpath,
                             kind == stat.S_IFREG, identity(store_st))
            if replacing is None:
                link_into_place(self.local, tmp, path, kind == stat.S_IFDIR)
            else:
                self.local.rename(tmp, path)
        except BaseException as err:
            with contextlib.suppress(OSError):
                self.local.rmdir(tmp) if kind == stat.S_IFDIR else self.local.unlink(tmp)
            self.state.forget(st.st_ino)
            if isinstance(err, FileExistsError):
                return self.local.lstat_or_none(path)  # made here meanwhile: it wins
            raise
        self.paths[st.st_ino] = path
        if replacing is not None:
            self.state.forget(replacing.st_ino)
            self.tier.bump_epoch()  # every process drops its descriptors of the old one
            self.drop_fd(replacing.st_ino)
        return self.local.lstat(path)

    def remove_copy(self, path: bytes, st: os.stat_result) -> None:
        """Remove local copy `path` (its store entry changed or went); a directory keeps
        what in it was written here and not drained, and then stays itself."""
        if stat.S_ISDIR(st.st_mode):
            self.prune_inside(path)
            try:
                self.local.rmdir(path)
            except OSError:
                return
        else:
            self.local.unlink(path)
        self.state.forget(st.st_ino)
        self.tier.bump_epoch()  # every process drops its descriptors of it
        self.drop_fd(st.st_ino)

    def prune_inside(self, directory: bytes) -> None:
        for name, st in self.local.entries(directory).items():
            path = os.path.join(directory, name)
            if self.follows(self.state.tracking(st.st_ino), st, path):
                self.remove_copy(path, st)
            elif stat.S_ISDIR(st.st_mode):
                self.prune_inside(path)

    def merge(self, nodeid: int, directory: bytes) -> None:
        """Before a listing from its start: adopt what the store's directory holds and
        this one lacks, and bring the copies in it up to date. Costs one listing of the
        store's directory and one lstat per store entry that is new here or a copy of a
        file or symlink; changes take the mutating lock, nothing else does."""
        relpath = directory
        try:
            on_store = {name: st for name, st in self.store.entries(relpath).items()
                        if not hidden(name)}
        except (FileNotFoundError, NotADirectoryError):
            on_store = {}
        except OSError as err:
            self.trouble("read", err, f"checkpoint store {self.tier.store} cannot be "
                                "read; ckpt/ shows this node's files only meanwhile")
            return
        local = {name: st for name, st in self.local.entries(directory).items()
                 if not is_adopt_temporary(name)}
        rows = self.state.tracking_many([st.st_ino for st in local.values()])
        todo = []
        for name, st in local.items():
            row = rows.get(st.st_ino)
            if not self.follows(row, st, os.path.join(relpath, name)):
                continue
            entry = on_store.get(name)
            if entry is None:
                todo.append(name)
            elif stat.S_ISDIR(st.st_mode):
                if not stat.S_ISDIR(entry.st_mode):
                    todo.append(name)
            elif not same_copy(row, st.st_mode, entry):
                todo.append(name)
        todo += [name for name, entry in on_store.items() if name not in local and
                 stat.S_IFMT(entry.st_mode) in ADOPTABLE]
        if not todo:
            return
        with self.tier.mutating():
            for name in todo:
                try:
                    self.reconcile(nodeid, directory, name)
                except OSError as err:
                    log.warning("checkpoint entry %s of the store not shown in ckpt/ (%s)",
                                os.fsdecode(os.path.join(relpath, name)), err.strerror)

    def changed_since_seen(self, path: bytes, st: os.stat_result) -> bool:
        """Local file `path` is a copy of the store's whose store copy changed or went
        since this node looked (a read-only open then answers ESTALE)."""
        row = self.state.tracking(st.st_ino)
        if not self.follows(row, st, path):
            return False
        store_st, ok = self.entry(path)
        if not ok or (store_st is not None and same_copy(row, st.st_mode, store_st)):
            return False
        return store_st is not None or self.tier.store_reachable()


ADOPTABLE = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK)


def adoptable(name: bytes, store_st: os.stat_result) -> bool:
    """A store entry `ckpt/` shows: files, directories, symlinks; never a copy in
    progress (a drain's hidden temporary) nor a special file."""
    return stat.S_IFMT(store_st.st_mode) in ADOPTABLE and not hidden(name)


def hidden(name: bytes) -> bool:
    """A store name `ckpt/` never shows: a drain's temporary, one it would take for a
    placeholder being made, or the sums directory (dlfsd.ckpt.sums; only ever at the
    store's root, reserved in every directory: one rule is simpler to state)."""
    return is_drain_temporary(name) or is_adopt_temporary(name) or name == sums.SUMS_DIR


def is_copy(row: Tracking | None, st: os.stat_result, relpath: bytes) -> TypeGuard[Tracking]:
    """Local entry `st` at `relpath` is only a copy of the store's entry there, unchanged
    here since it was made (it follows the store): a placeholder, a drained file not
    written since, a directory or symlink mirrored on (or adopted from) the store."""
    if row is None or row.relpath != relpath or row.pending:
        return False
    if stat.S_ISREG(st.st_mode):
        return row.evicted or (row.size, row.mtime_ns) == (st.st_size, st.st_mtime_ns)
    return True


def same_copy(row: Tracking, local_mode: int, store_st: os.stat_result) -> bool:
    """The store's entry is still the one the local copy was made of (the same kind;
    for files and symlinks the same size, mtime and inode as seen then: another node's
    drain renames a new inode into place). A change time moved alone (a chmod, an
    in-place write with the mtime put back) is not a new version to follow: the local
    copy stays, and the drain's decisions (evict, replace) see the difference."""
    if stat.S_IFMT(store_st.st_mode) != stat.S_IFMT(local_mode):
        return False
    if stat.S_ISDIR(local_mode):
        return True
    if row.seen is not None:
        return same_file(store_st, row.seen)
    return (store_st.st_size, store_st.st_mtime_ns) == (row.size, row.mtime_ns)


def link_into_place(local: Beneath, tmp: bytes, path: bytes, directory: bool) -> None:
    """Give the made placeholder `tmp` its name `path`, never replacing an entry made
    meanwhile (FileExistsError): a hard link for files and symlinks; a directory is
    renamed (mkdir and symlink hold the mutating lock we hold, and a rename of a
    directory never replaces a file)."""
    if not directory:
        try:
            local.link(tmp, path)
        except FileExistsError:
            raise
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise
        else:
            local.unlink(tmp)
            return
    if local.exists(path):
        raise FileExistsError(errno.EEXIST, "made meanwhile", path)
    local.rename(tmp, path)


def store_holds_entries(tier: Tier, relpath: bytes) -> bool:
    """The store's directory at `relpath` holds entries (copies in progress aside)."""
    try:
        return any(not is_drain_temporary(n) for n in tier.store_fs.listdir(relpath))
    except OSError:
        return False


def rmdir_on_store(tier: Tier, relpath: bytes) -> None:
    """rmdir of an empty local directory, on the store first: ENOTEMPTY when the store's
    holds entries (not adopted here yet); one holding only copies in progress is left
    to the drain, which removes it with its temporary."""
    try:
        tier.store_fs.rmdir(relpath)
    except FileNotFoundError:
        pass
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            if store_holds_entries(tier, relpath):
                raise OSError(errno.ENOTEMPTY, "the checkpoint store's directory holds entries",
                              relpath) from None
            return
        log.warning(
            "checkpoint %s removed here but not on the store (%s): remove %s by hand",
            os.fsdecode(relpath), err.strerror, tier.store_fs.display(relpath))


def remove_on_store(tier: Tier, relpath: bytes, directory: bool) -> None:
    """Remove the store's copy at `relpath` (and a file's sums with it)."""
    try:
        if directory:
            tier.store_fs.rmdir(relpath)
        else:
            gone = tier.store_fs.lstat(relpath)
            tier.store_fs.unlink(relpath)
            sums.remove(tier.store_fs, gone)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning(
            "checkpoint %s removed here but not on the store (%s): remove %s by hand",
            os.fsdecode(relpath), err.strerror, tier.store_fs.display(relpath))


def rename_on_store(tier: Tier, old: bytes, new: bytes) -> Identity | Literal[False] | None:
    """Move the store's copy of `old` to `new` if there is one. Returns the moved copy's
    identity (its change time moved with it), None if the store had nothing at `old`,
    False if it could not (the drain then copies the file again under its new name)."""
    store = tier.store_fs
    try:
        source = store.lstat_or_none(old)
        if source is None:
            return None
        tier.makedirs_on_store(os.path.dirname(new))
        replaced = store.lstat_or_none(new)
        if replaced is not None and replaced.st_ino == source.st_ino:
            replaced = None  # the same file (a rename onto itself): its sums stay
        store.rename(old, new)
        sums.remove(store, replaced)  # (the moved copy keeps its own)
        return identity(store.lstat(new))
    except OSError as err:
        log.warning(
            "checkpoint %s renamed to %s here but not on the store (%s); it is drained "
            "again under its new name", os.fsdecode(old), os.fsdecode(new), err.strerror)
        return False


def symlink_on_store(tier: Tier, relpath: bytes, target: bytes) -> Identity:
    """A symlink on the store, made under a hidden name and renamed into place."""
    tier.makedirs_on_store(os.path.dirname(relpath))
    tmp = os.path.join(os.path.dirname(relpath), tmp_name(os.path.basename(relpath)))
    tier.store_fs.symlink(target, tmp)
    try:
        tier.store_fs.rename(tmp, relpath)
    except OSError:
        with contextlib.suppress(OSError):
            tier.store_fs.unlink(tmp)
        raise
    return identity(tier.store_fs.lstat(relpath))

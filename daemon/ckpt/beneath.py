"""Beneath: a directory tree reached only from its root's descriptor, never by a path
string, never through a symlink, and with the job user's credentials (dlfsd.ckpt.creds).

Why: the checkpoint tier works in two trees a job's user shapes, the checkpoint store
(a directory the user owns) and the local tree (filled through `ckpt/`). A path-based
call (`open("STORE/d/x")`) follows whatever `d` is when the call runs: a symlink the
user planted there a moment ago turns a root daemon's read or write into one of any
file on the node. Here every operation names an entry by a path relative to the
tree's root (`b"d/x"`); its directory is opened from the root's descriptor with
openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) where the
kernel has it (Linux >= 5.6), else one component at a time with O_NOFOLLOW; the
entry itself is then reached with the *at call and AT_SYMLINK_NOFOLLOW (O_NOFOLLOW),
so a symlink anywhere on the way fails (ELOOP, ENOTDIR) instead of leading out. Modes
are changed through a descriptor, never on a symlink. systemd's chase() and libfuse's
passthrough_hp resolve the same way.

Relative paths are bytes, '/'-separated, without '.', '..' or empty components; b""
is the root itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Callable, Iterator

from dlfsd.ckpt.creds import Creds

RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x02, 0x04, 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture (a syscall newer than 424)
_O_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_openat2_works: bool | None = None  # None: not tried yet


def _openat2(dirfd: int, path: bytes, flags: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, 0,
                   RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(dirfd),
                       ctypes.c_char_p(path), ctypes.byref(how),
                       ctypes.c_long(ctypes.sizeof(how)))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return fd


def check_relpath(rel: bytes) -> list[bytes]:
    """The components of relative path `rel` (EINVAL for an absolute path, '.', '..' or
    an empty component: nothing a caller sends may name a place outside)."""
    if not rel:
        return []
    parts = rel.split(b"/")
    if any(p in (b"", b".", b"..") for p in parts) or b"\0" in rel:
        raise OSError(errno.EINVAL, "not a plain relative path", rel)
    return parts


def open_dir_beneath(rootfd: int, rel: bytes, flags: int = _O_PATH_DIR) -> int:
    """A descriptor of directory `rel` under `rootfd`, no symlink followed on the way
    (with `flags`: O_PATH for a directory to work in, O_RDONLY to list it)."""
    global _openat2_works
    parts = check_relpath(rel)
    if not parts:
        return os.open(".", flags | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=rootfd)
    if _openat2_works is not False:
        try:
            fd = _openat2(rootfd, rel, flags | os.O_DIRECTORY)
            _openat2_works = True
            return fd
        except OSError as err:
            # ENOSYS: an older kernel; EPERM, E2BIG: a seccomp filter (containers) that
            # does not know it. Anything else is the answer.
            if _openat2_works or err.errno not in (errno.ENOSYS, errno.EPERM, errno.E2BIG):
                raise
            _openat2_works = False
    fd = os.open(".", _O_PATH_DIR, dir_fd=rootfd)
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            step = os.open(part, (flags if last else _O_PATH_DIR) | os.O_DIRECTORY
                           | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = step
            if not stat.S_ISDIR(os.fstat(fd).st_mode):  # O_PATH|O_NOFOLLOW: the link itself
                raise OSError(errno.ENOTDIR, "not a directory", rel)
        return fd
    except BaseException:
        os.close(fd)
        raise


class _At:
    """`with _At(tree, rel) as (dirfd, name)`: the directory holding `rel` and its last
    component, under the user's credentials for the block. A class, not a generator:
    it runs around every operation of the tier (a lookup makes two or three)."""

    __slots__ = ("fd", "own", "rel", "tree")

    def __init__(self, tree: Beneath, rel: bytes) -> None:
        self.tree, self.rel, self.own = tree, rel, False

    def __enter__(self) -> tuple[int, bytes]:
        rel = self.rel
        slash = rel.rfind(b"/")
        if slash < 0:  # an entry of the root: no directory to open
            if rel in (b"", b".", b"..") or b"\0" in rel:
                raise OSError(errno.EINVAL, "not a plain relative path", rel)
        else:
            check_relpath(rel)
        creds = self.tree.creds
        creds.__enter__()
        try:
            root, own_root = self.tree._root_fd()
            if slash < 0:
                self.fd, self.own = root, own_root
                return root, rel
            try:
                self.fd = open_dir_beneath(root, rel[:slash])
            finally:
                if own_root:
                    os.close(root)
            self.own = True
            return self.fd, rel[slash + 1:]
        except BaseException:
            creds.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            if self.own:
                os.close(self.fd)
        finally:
            self.tree.creds.__exit__(*exc)


class Beneath:
    """Operations on entries of the tree under `root`, as `creds`' user.

    `root_fd`: the root's descriptor, held for the tree's lifetime (the local tree,
    whose path runs through the daemon's own 0700 directories: opened by the daemon).
    None: the root path is opened as the user for each operation (the store, which an
    admin may mount over its directory, bind read-only, or make, after the daemon
    started: a descriptor kept from before would write under the new mount, where
    nobody sees it)."""

    def __init__(self, root: str | bytes | os.PathLike, creds: Creds,
                 root_fd: int | None = None) -> None:
        self.path = os.fsencode(root)
        self.creds = creds
        self._rootfd = root_fd

    def close(self) -> None:
        if self._rootfd is not None:
            os.close(self._rootfd)
            self._rootfd = None

    def display(self, rel: bytes) -> str:
        """The entry's path, for messages only (never to act on)."""
        return os.fsdecode(os.path.join(self.path, rel) if rel else self.path)

    # -- resolution -------------------------------------------------------------------
    def _root_fd(self) -> tuple[int, bool]:
        """(the root's descriptor, whether the caller must close it); call with the
        user's credentials held."""
        if self._rootfd is not None:
            return self._rootfd, False
        return os.open(self.path, _O_PATH_DIR), True

    def at(self, rel: bytes) -> _At:
        """`with tree.at(rel) as (dirfd, name)`: the directory holding `rel` (opened
        beneath the root, no link followed) and its last component, under the user's
        credentials for the whole block."""
        return _At(self, rel)

    @contextlib.contextmanager
    def directory(self, rel: bytes, listing: bool = False) -> Iterator[int]:
        """A descriptor of directory `rel` (O_RDONLY with `listing`, else O_PATH)."""
        flags = (os.O_RDONLY if listing else os.O_PATH) | os.O_DIRECTORY | os.O_CLOEXEC
        with self.creds:
            root, own_root = self._root_fd()
            try:
                fd = open_dir_beneath(root, rel, flags)
            finally:
                if own_root:
                    os.close(root)
            try:
                yield fd
            finally:
                os.close(fd)

    # -- entries ------------------------------------------------------------------------
    def lstat(self, rel: bytes) -> os.stat_result:
        if not rel:
            with self.directory(b"") as fd:
                return os.fstat(fd)
        with self.at(rel) as (fd, name):
            return os.stat(name, dir_fd=fd, follow_symlinks=False)

    def lstat_or_none(self, rel: bytes) -> os.stat_result | None:
        try:
            return self.lstat(rel)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def exists(self, rel: bytes) -> bool:
        return self.lstat_or_none(rel) is not None

    def isdir(self, rel: bytes) -> bool:
        try:
            return stat.S_ISDIR(self.lstat(rel).st_mode)
        except OSError:
            return False

    def open(self, rel: bytes, flags: int, mode: int = 0o600) -> int:
        """A descriptor of file `rel` (never through a symlink: ELOOP)."""
        with self.at(rel) as (fd, name):
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)

    def listdir(self, rel: bytes) -> list[bytes]:
        with self.directory(rel, listing=True) as fd:
            return [os.fsencode(n) for n in os.listdir(fd)]

    def entries(self, rel: bytes) -> dict[bytes, os.stat_result]:
        """Each entry of directory `rel` and its lstat (one gone meanwhile is left out)."""
        out = {}
        with self.directory(rel, listing=True) as fd:
            for name in os.listdir(fd):
                with contextlib.suppress(FileNotFoundError):
                    out[os.fsencode(name)] = os.stat(name, dir_fd=fd, follow_symlinks=False)
        return out

    def mkdir(self, rel: bytes, mode: int) -> None:
        with self.at(rel) as (fd, name):
            os.mkdir(name, mode, dir_fd=fd)

    def makedirs(self, rel: bytes, mode: int = 0o755) -> None:
        """Directory `rel` and those above it, made where missing (none followed)."""
        parts = check_relpath(rel)
        for end in range(1, len(parts) + 1):
            with contextlib.suppress(FileExistsError):
                self.mkdir(b"/".join(parts[:end]), mode)
        if parts and not self.isdir(rel):
            raise OSError(errno.ENOTDIR, "not a directory", self.display(rel))

    def rmdir(self, rel: bytes) -> None:
        with self.at(rel) as (fd, name):
            os.rmdir(name, dir_fd=fd)

    def unlink(self, rel: bytes) -> None:
        with self.at(rel) as (fd, name):
            os.unlink(name, dir_fd=fd)

    def symlink(self, target: bytes, rel: bytes) -> None:
        with self.at(rel) as (fd, name):
            os.symlink(target, name, dir_fd=fd)

    def readlink(self, rel: bytes) -> bytes:
        with self.at(rel) as (fd, name):
            return os.readlink(name, dir_fd=fd)

    def rename(self, old: bytes, new: bytes) -> None:
        with self.at(old) as (old_fd, old_name), self.at(new) as (new_fd, new_name):
            os.rename(old_name, new_name, src_dir_fd=old_fd, dst_dir_fd=new_fd)

    def link(self, old: bytes, new: bytes) -> None:
        """A hard link of entry `old` (a symlink: the link itself)."""
        with self.at(old) as (old_fd, old_name), self.at(new) as (new_fd, new_name):
            os.link(old_name, new_name, src_dir_fd=old_fd, dst_dir_fd=new_fd,
                    follow_symlinks=False)

    def utime(self, rel: bytes, ns: tuple[int, int]) -> None:
        with self.at(rel) as (fd, name):
            os.utime(name, ns=ns, dir_fd=fd, follow_symlinks=False)

    def chmod(self, rel: bytes, mode: int) -> None:
        """Change the mode of a file or directory through a descriptor of it; a symlink
        is refused (EPERM): chmod through one would change what it points at."""
        with self.at(rel) as (fd, name):
            entry = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                if stat.S_ISLNK(os.fstat(entry).st_mode):
                    raise OSError(errno.EPERM, "a symlink's mode is not changed", rel)
                # An O_PATH descriptor takes no fchmod; its /proc link names this very
                # inode (what glibc's fchmodat(AT_SYMLINK_NOFOLLOW) does too).
                os.chmod(f"/proc/self/fd/{entry}", mode)
            finally:
                os.close(entry)

    def truncate(self, rel: bytes, size: int) -> None:
        fd = self.open(rel, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def fsync_dir(self, rel: bytes) -> None:
        with self.directory(rel, listing=True) as fd:
            os.fsync(fd)

    def statvfs(self) -> os.statvfs_result:
        with self.directory(b"") as fd:
            return os.fstatvfs(fd)

    def walk(self, rel: bytes = b"", skip: Callable[[bytes], bool] | None = None
             ) -> list[tuple[bytes, list[tuple[bytes, os.stat_result]]]]:
        """(directory, [(name, lstat)]) for `rel` and every directory below it, parents
        first; never into a symlink; names `skip` says yes to are left out (and not
        entered). Read at once: checkpoint trees are small, and the credentials must
        hold while it runs."""
        out: list = []
        with self.directory(rel, listing=True) as fd:
            self._walk(fd, rel, out, skip)
        return out

    def _walk(self, fd: int, rel: bytes, out: list, skip) -> None:
        entries = []
        for name in os.listdir(fd):
            bname = os.fsencode(name)
            if skip is not None and skip(bname):
                continue
            try:
                entries.append((bname, os.stat(name, dir_fd=fd, follow_symlinks=False)))
            except FileNotFoundError:
                continue
        out.append((rel, entries))
        for bname, st in entries:
            if not stat.S_ISDIR(st.st_mode):
                continue
            try:
                child = os.open(bname, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                continue  # gone or swapped meanwhile
            try:
                self._walk(child, os.path.join(rel, bname) if rel else bname, out, skip)
            finally:
                os.close(child)

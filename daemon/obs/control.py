"""ControlFiles: the read-only virtual directory `MOUNTPOINT/.dlfs/`.

`.dlfs` answers lookup from the root but is not listed by readdir of the root,
so `ls MOUNTPOINT` still shows exactly the datasets (like a dot file, only
more hidden; `ls MOUNTPOINT/.dlfs` lists its files). Inodes come from the
reserved range 2..1022 (1023 is the checkpoint mountpoint, dlfsd.core.namespace).

When the daemon sees opens (`--count-opens`, or an old kernel), each file is
rendered once per open (one consistent snapshot per reader) and served with
direct_io, so the kernel never caches stale content. Otherwise the kernel
opens files without asking (FUSE no_open): the reading process gets a
snapshot when it looks the file up (latest_attr, read_latest), and the worker
reports these attributes with a zero timeout, so each read() revalidates and
a new snapshot drops the old one's cached pages. Because a read may reach any
of the daemon's processes, not the one that handled the open or lookup, the
rendered bytes go to a file in a private tmpfs directory that all processes
share (named after the handle, or inode and pid); release removes it (old
per-pid snapshots go after a minute), unmount removes the directory, and the
next daemon removes one whose daemon was killed. Handles are CONTROL_FH |
process slot << 40 | counter.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
import weakref
from collections.abc import Callable

from dlfs.errors import NotADirError, NotFoundError
from dlfs.procs import pid_alive
from dlfsd.base.slots import ProcessSlot

CONTROL_DIR_NAME = b".dlfs"
CONTROL_DIR_INODE = 2
LAST_CONTROL_INODE = 1022  # 1023: dlfsd.core.namespace.CKPT_DIR_INODE
CONTROL_FH = 1 << 62
SNAPSHOT_FRESH = 0.5  # seconds a no-open reader's snapshot is reused (see latest_attr)
SNAPSHOT_MAX_AGE = 60.0  # seconds before an unused one is removed
DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444

# (ino, mode, size, mtime_ns, nlink), the fields of dlfsd.core.values.Attr
AttrTuple = tuple[int, int, int, int, int]


def _content_parent() -> str | None:
    """Where rendered files go: /dev/shm (RAM) if usable, else the default temp dir."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else None


_PREFIX = "dlfs-views-"


def _remove_stale_dirs(parent: str) -> None:
    """Remove our rendered-file directories left by daemons that were killed (pid gone)."""
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            pid = entry.name[len(_PREFIX):].split("-", 1)[0]
            if (entry.name.startswith(_PREFIX) and pid.isdigit() and not pid_alive(int(pid))
                    and entry.stat(follow_symlinks=False).st_uid == os.getuid()):
                shutil.rmtree(entry.path, ignore_errors=True)


def _pread_file(path: str, size: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def _remove_dir(path: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


class ControlFiles:
    """The `.dlfs/` directory over a set of renderers (file name -> bytes at open)."""

    def __init__(self, renderers: dict[bytes, Callable[[], bytes]], slot: ProcessSlot) -> None:
        self._renderers: dict[bytes, Callable[[], bytes]] = {}
        for name, render in renderers.items():
            self.add(name, render)
        self.slot = slot
        self.created_ns = time.time_ns()
        parent = _content_parent() or tempfile.gettempdir()
        _remove_stale_dirs(parent)
        self._dir = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent)
        # Removed by close(), or when this object goes away, in the creating process only.
        self._remove_dir = weakref.finalize(self, _remove_dir, self._dir, os.getpid())
        self._opened = 0

    def add(self, name: bytes, render: Callable[[], bytes]) -> None:
        """One more file, e.g. the order socket's name (dlfsd.core.ordersock); before the
        mount (inodes are renumbered)."""
        self._renderers[name] = render
        self.names = sorted(self._renderers)
        self._inode = {n: CONTROL_DIR_INODE + 1 + i for i, n in enumerate(self.names)}
        self._name = {ino: n for n, ino in self._inode.items()}
        assert CONTROL_DIR_INODE + len(self.names) <= LAST_CONTROL_INODE

    def close(self) -> None:
        """Remove the rendered files (a no-op in forked workers)."""
        self._remove_dir()

    @staticmethod
    def owns(ino: int) -> bool:
        return CONTROL_DIR_INODE <= ino <= LAST_CONTROL_INODE

    # -- metadata -------------------------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> int:
        if parent != CONTROL_DIR_INODE:
            raise NotADirError(parent)
        ino = self._inode.get(name)
        if ino is None:
            raise NotFoundError(name)
        return ino

    def attr(self, ino: int) -> AttrTuple:
        if ino == CONTROL_DIR_INODE:
            return (ino, DIR_MODE, 0, self.created_ns, 2)
        if ino not in self._name:
            raise NotFoundError(f"no inode {ino}")
        # Size 0: the content exists only per open; direct_io reads it to EOF anyway.
        return (ino, FILE_MODE, 0, self.created_ns, 1)

    def is_dir(self, ino: int) -> bool:
        self.attr(ino)
        return ino == CONTROL_DIR_INODE

    def readdir(self, start: int):
        """Yield (name, AttrTuple, next_offset) of `.dlfs/` from offset `start`."""
        for i in range(start, len(self.names)):
            name = self.names[i]
            yield name, self.attr(self._inode[name]), i + 1

    # -- data -----------------------------------------------------------------------
    def open(self, ino: int) -> int:
        """Render the file now; return its handle."""
        name = self._name.get(ino)
        if name is None:
            raise NotFoundError(f"no inode {ino}")
        content = self._renderers[name]()
        self._opened += 1
        fh = CONTROL_FH | self.slot.index << 40 | self._opened
        path = self._path(fh)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)
        return fh

    def read(self, fh: int, offset: int, size: int) -> bytes:
        return _pread_file(self._path(fh), size, offset)

    def latest_attr(self, ino: int, pid: int) -> AttrTuple:
        """Attributes of the snapshot process `pid` reads next (FUSE no_open).

        Without opens, a snapshot is made when the reading process looks the
        file up or stats it (which the kernel does before each read() of it,
        as these attributes carry a zero timeout), and reused for SNAPSHOT_FRESH
        seconds, so the reads of one pass over the file see one snapshot. The
        size is the snapshot's and the mtime its render time: a new snapshot
        makes the kernel drop the old one's cached pages.
        """
        path = self._snapshot_path(ino, pid)
        try:
            st = os.stat(path)
            if time.time() - st.st_mtime < SNAPSHOT_FRESH:
                return (ino, FILE_MODE, st.st_size, st.st_mtime_ns, 1)
        except FileNotFoundError:
            pass
        content = self._renderers[self._name[ino]]()
        self._remove_old_snapshots()
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(content)
        os.replace(tmp, path)  # readers of `path` never see a partial snapshot
        return (ino, FILE_MODE, len(content), os.stat(path).st_mtime_ns, 1)

    def read_latest(self, ino: int, pid: int, offset: int, size: int) -> bytes:
        """Read the snapshot latest_attr gave process `pid` (making one if there is none)."""
        if ino not in self._name:
            raise NotFoundError(f"no inode {ino}")
        path = self._snapshot_path(ino, pid)
        try:
            return _pread_file(path, size, offset)
        except FileNotFoundError:
            self.latest_attr(ino, pid)
            return _pread_file(path, size, offset)

    def _snapshot_path(self, ino: int, pid: int) -> str:
        if ino not in self._name:
            raise NotFoundError(f"no inode {ino}")
        return os.path.join(self._dir, f"i{ino}-p{pid}")

    def _remove_old_snapshots(self) -> None:
        too_old = time.time() - SNAPSHOT_MAX_AGE
        with contextlib.suppress(OSError), os.scandir(self._dir) as entries:
            for entry in entries:
                if entry.name.startswith("i") and entry.stat().st_mtime < too_old:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    def release(self, fh: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(fh))

    def _path(self, fh: int) -> str:
        return os.path.join(self._dir, f"{fh:x}")

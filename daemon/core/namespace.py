"""Namespace: the mount's tree over one or more datasets, addressed by inode.

Inode 1 is the mount root, whose children are the datasets. Inodes 2..1022
are reserved for control files (`.dlfs/`, see dlfsd.obs.control; hidden from
readdir of the root), 1023 is `ckpt/` (the checkpoint connection's
mountpoint); dataset k owns the block [base_k, base_k + rows_k), with
inode = base_k + row. Everything here is plain Python over the
SampleDirectory arrays: no pyfuse3, so tests drive it directly.

File handles: a dataset file's handle is its inode (stateless), except while
tracing, when it also names the opener (dlfsd.obs.trace); `.dlfs/` files get
per-open handles (dlfsd.obs.control). Counters and the trace are recorded here,
the one place that sees (dataset, row) and the caller (`caller`: anything
with .pid and .uid: the FUSE request header's, in the worker processes).
"""

from __future__ import annotations

import bisect
import os
import stat
import time
from time import perf_counter_ns
from typing import TYPE_CHECKING, Protocol

from dlfs.errors import (
    DlfsError,
    IsADirError,
    NoAttributeError,
    NotADirError,
    NotFoundError,
    ReadOnlyError,
)
from dlfs.store.directory import SampleDirectory
from dlfs.store.store import Dataset
from dlfsd.base.nodeids import CKPT_BIT, CKPT_NAME
from dlfsd.core.reader import SampleReader
from dlfsd.core.values import Attr, StatFs
from dlfsd.obs.control import CONTROL_DIR_INODE, CONTROL_DIR_NAME, CONTROL_FH
from dlfsd.obs.observe import Observability, ObserveConfig
from dlfsd.obs.trace import (
    CKPT_DATASET,
    OP_GETATTR,
    OP_LOOKUP,
    OP_OPEN,
    OP_READ,
    OP_RELEASE,
    OP_WRITE,
    TRACED_FH,
    handle_inode,
)

if TYPE_CHECKING:
    from dlfsd.pool.pool import ChunkPool

ROOT_INODE = 1
CKPT_DIR_INODE = 1023  # `ckpt/` here: the mountpoint of the checkpoint connection
FIRST_DATASET_INODE = 1024
ROOT_MODE = stat.S_IFDIR | 0o555
PRIVATE_ROOT_MODE = stat.S_IFDIR | 0o700  # a mount for one user (dlfs mount --uid)


#: Write-side open flags: a read-only mount refuses them (EROFS).
WRITE_OPEN_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT
#: Requests that would change the file system; every one is refused with EROFS.
CHANGE_REQUESTS = frozenset({"setattr", "mknod", "mkdir", "unlink", "rmdir", "symlink",
                             "rename", "link", "create", "write", "setxattr", "removexattr",
                             "fallocate", "copy_file_range", "tmpfile"})


class WriteCount(Protocol):
    """The mount's checkpoint write counter (dlfsd.ckpt.counters.WriteCounter)."""

    def add(self, nbytes: int) -> None: ...


class CkptWrites(Protocol):
    """What the Namespace needs of the checkpoint tree (dlfsd.ckpt.tree.CkptTree, a
    layer above the core): a WRITE into it, and its write counter (None: not counted),
    for files written through passthrough."""

    def write(self, nodeid: int, offset: int, data: bytes | memoryview) -> int: ...

    @property
    def written(self) -> WriteCount | None: ...


def _attr(d: SampleDirectory, base: int, row: int) -> Attr:
    mode = d.mode(row)
    nlink = 2 + d.subdir_count(row) if stat.S_ISDIR(mode) else 1
    return Attr(base + row, mode, d.size(row), d.mtime_ns(row), nlink)


class Namespace:
    """Maps inodes to (dataset, row) and answers lookup/getattr/readdir/read."""

    def __init__(self, datasets: list[Dataset], verify: bool = True,
                 observe: ObserveConfig | None = None, pool: ChunkPool | None = None,
                 store_rate: int = 0,
                 root_mode: int = ROOT_MODE, prefetch: bool = False) -> None:
        """Datasets are ordered by name; a pool must index them in that order too."""
        self.root_mode = root_mode
        self.datasets = sorted(datasets, key=lambda d: d.name)
        self.readers = [SampleReader(d, verify, pool=pool, ds_index=i,
                                     store_rate=store_rate, prefetch=prefetch)
                        for i, d in enumerate(self.datasets)]
        self.observe = Observability(self.datasets, observe or ObserveConfig())
        self.stats, self.trace, self.control = (
            self.observe.stats, self.observe.trace, self.observe.control)
        self._counting = self.stats.enabled
        self._tracing = self.trace.flag  # [0] is 1 while tracing (shared by all processes)
        self._requests = self.observe.requests  # the stall detector's slots
        for k, reader in enumerate(self.readers):
            reader.stats, reader.ds, reader.requests = self.stats, k, self._requests
        if pool is not None:
            self.observe.watch_pool(pool)
        self._dirs = [d.directory for d in self.datasets]
        self._bases: list[int] = []
        base = FIRST_DATASET_INODE
        for d in self.datasets:
            self._bases.append(base)
            base += len(d.directory)
        self._end = base
        self._by_name = {d.name.encode(): i for i, d in enumerate(self.datasets)}
        self.mounted_ns = time.time_ns()
        # the writable checkpoint subtree (dlfsd.ckpt.tree), if any; `_ckpt` is set with
        # it (attach_ckpt), for the writes into it: only its inodes get them
        self.ckpt: CkptWrites | None = None
        self.ckpt_link: bytes | None = None  # `ckpt` is a symlink to this (not root)

    def attach_ckpt(self, ckpt: CkptWrites, link: bytes | None = None) -> None:
        """Show `ckpt/` in the root, an empty directory: the checkpoint tier (a
        dlfsd.ckpt.tree.CkptTree) is a FUSE connection of its own mounted on it
        (dlfsd.fuse.rawsession); the tree is kept here for the write counter and trace.
        `link`: the connection is mounted there instead (a daemon that is not root,
        see dlfs.runtime.ckpt_mount_path), and `ckpt` is a symlink to it."""
        if CKPT_NAME in self._by_name:
            raise DlfsError("a dataset named ckpt cannot be mounted with --ckpt-store (the "
                            "checkpoint directory takes MOUNTPOINT/ckpt); mount the other "
                            "datasets with --dataset, or rename that dataset")
        self.ckpt = self._ckpt = ckpt
        self.ckpt_link = link

    def use_spans(self, max_length: int) -> None:
        """Worker processes that splice replies: reads of verified bytes up to
        `max_length` may return a dlfsd.core.values.FileSpan (0: never)."""
        for reader in self.readers:
            reader.use_spans(max_length)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.observe.close()

    # -- inode arithmetic ---------------------------------------------------
    def _locate(self, ino: int) -> tuple[int, int]:
        """(dataset index, row) of a dataset inode; NotFoundError otherwise."""
        if not FIRST_DATASET_INODE <= ino < self._end:
            raise NotFoundError(f"no inode {ino}")
        k = bisect.bisect_right(self._bases, ino) - 1
        return k, ino - self._bases[k]

    def inode_of(self, k: int, row: int) -> int:
        """The inode of row `row` of dataset `k` (in self.datasets' order)."""
        return self._bases[k] + row

    # -- metadata -------------------------------------------------------------
    def lookup(self, parent: int, name: bytes, caller=None) -> int:
        if caller is None or not self._tracing[0]:
            return self._lookup(parent, name)
        started = perf_counter_ns()
        ino = self._lookup(parent, name)
        self._trace_inode(OP_LOOKUP, ino, caller, started)
        return ino

    def _lookup(self, parent: int, name: bytes) -> int:
        if parent == ROOT_INODE:
            k = self._by_name.get(name)
            if k is None:
                if name == CONTROL_DIR_NAME:
                    return CONTROL_DIR_INODE
                if name == CKPT_NAME and self.ckpt is not None:
                    return CKPT_DIR_INODE
                raise NotFoundError(name)
            return self._bases[k]
        if self.control.owns(parent):
            return self.control.lookup(parent, name)
        if parent == CKPT_DIR_INODE:  # the checkpoint connection's mountpoint, empty
            raise NotFoundError(name)
        k, row = self._locate(parent)
        directory = self._dirs[k]
        if not directory.is_dir(row):
            raise NotADirError(parent)
        child = directory.lookup(row, name)
        if child < 0:
            raise NotFoundError(name)
        return self._bases[k] + child

    def getattr(self, ino: int, caller=None) -> Attr:
        if caller is None or not self._tracing[0]:
            return self._getattr(ino)
        started = perf_counter_ns()
        attr = self._getattr(ino)
        self._trace_inode(OP_GETATTR, ino, caller, started)
        return attr

    def _getattr(self, ino: int) -> Attr:
        if ino == ROOT_INODE:
            return Attr(ROOT_INODE, self.root_mode, 0, self.mounted_ns,
                        2 + len(self.datasets) + (self.ckpt is not None))
        if ino == CKPT_DIR_INODE and self.ckpt is not None:
            if self.ckpt_link is not None:
                return Attr(CKPT_DIR_INODE, stat.S_IFLNK | 0o777, len(self.ckpt_link),
                            self.mounted_ns, 1)
            return Attr(CKPT_DIR_INODE, self.root_mode, 0, self.mounted_ns, 2)
        if ino < FIRST_DATASET_INODE:
            return Attr(*self.control.attr(ino))
        k, row = self._locate(ino)
        return _attr(self._dirs[k], self._bases[k], row)

    def control_attr(self, ino: int, pid: int) -> Attr:
        """Attributes of a `.dlfs/` entry as process `pid` will read it without an open."""
        if self.control.is_dir(ino):
            return Attr(*self.control.attr(ino))
        return Attr(*self.control.latest_attr(ino, pid))

    def readlink(self, ino: int) -> bytes:
        if ino == CKPT_DIR_INODE and self.ckpt_link is not None:
            return self.ckpt_link
        k, row = self._locate(ino)
        try:
            return self._dirs[k].readlink(row)
        except KeyError:
            raise NotFoundError(f"inode {ino} is not a symlink") from None

    def check_dir(self, ino: int) -> None:
        if ino == CKPT_DIR_INODE:
            if not stat.S_ISDIR(self._getattr(ino).mode):  # the symlink of a non-root mount
                raise NotADirError(ino)
        elif self.control.owns(ino):
            if not self.control.is_dir(ino):
                raise NotADirError(ino)
        elif ino != ROOT_INODE:
            k, row = self._locate(ino)
            if not self._dirs[k].is_dir(row):
                raise NotADirError(ino)

    def check_file(self, ino: int) -> None:
        if ino in (ROOT_INODE, CKPT_DIR_INODE) or (self.control.owns(ino)
                                                   and self.control.is_dir(ino)):
            raise IsADirError(ino)
        if self.control.owns(ino):
            return
        k, row = self._locate(ino)
        if self._dirs[k].is_dir(row):
            raise IsADirError(ino)

    def readdir(self, ino: int, start: int):
        """Yield (name, Attr, next_offset) from offset `start`; offsets are stable.

        Attributes come along because the kernel asks for readdirplus: one pass
        over the arrays, no per-entry inode lookup.
        """
        if ino == ROOT_INODE:
            for i in range(start, len(self.datasets)):
                yield self.datasets[i].name.encode(), _attr(self._dirs[i], self._bases[i], 0), i + 1
            if self.ckpt is not None and start <= len(self.datasets):
                yield CKPT_NAME, self._getattr(CKPT_DIR_INODE), len(self.datasets) + 1
            return
        if ino == CKPT_DIR_INODE:  # the mountpoint of the checkpoint connection
            self._getattr(ino)
            return
        if ino == CONTROL_DIR_INODE:
            for name, attr, next_offset in self.control.readdir(start):
                yield name, Attr(*attr), next_offset
            return
        k, row = self._locate(ino)
        d, base = self._dirs[k], self._bases[k]
        kids = d.children(row)
        for off in range(start, len(kids)):
            child = kids[off]
            yield d.name(child), _attr(d, base, child), off + 1

    def dataset_directory(self, ino: int) -> tuple[SampleDirectory, int, int] | None:
        """(directory, inode of its row 0, row) for a dataset inode; None for the root
        and `.dlfs/` (for packing whole listings at once, see dlfsd.fuse.listing)."""
        if ino < FIRST_DATASET_INODE:
            return None
        k, row = self._locate(ino)
        return self._dirs[k], self._bases[k], row

    def statfs(self) -> StatFs:
        """The mount's size (all mounted datasets) and entries; a read-only mount is full."""
        nbytes = sum(int(d.stats["bytes"]) for d in self.datasets)
        return StatFs(blocks=(nbytes + 4095) // 4096, files=self._end - FIRST_DATASET_INODE + 1)

    # -- the read-only policy: both FUSE adapters ask here, neither decides ----------
    def is_control(self, ino: int) -> bool:
        """`ino` is a `.dlfs/` entry (rendered per reader, never cached by the kernel)."""
        return self.control.owns(ino)

    def check_open(self, ino: int, flags: int) -> None:
        """Refuse an open for writing (EROFS); which inodes open at all is `open`'s call."""
        if flags & WRITE_OPEN_FLAGS:
            raise ReadOnlyError(ino)

    def check_access(self, ino: int, mode: int) -> None:
        """access(2): anything but write access to an existing entry is granted (and
        write access in the checkpoint subtree)."""
        if ino == CKPT_DIR_INODE:  # fusermount3 checks write access to its mountpoint
            self._getattr(ino)
            return
        if mode & os.W_OK:
            raise ReadOnlyError(ino)
        self._getattr(ino)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        """Entries have no extended attributes (ENODATA for an existing entry)."""
        self._getattr(ino)
        raise NoAttributeError(name)

    def listxattr(self, ino: int) -> list[bytes]:
        """The names of an existing entry's extended attributes: none."""
        self._getattr(ino)
        return []

    def refuse_change(self, request: str) -> None:
        """Every request in CHANGE_REQUESTS: the mount is read-only."""
        raise ReadOnlyError(request)

    # -- data ------------------------------------------------------------------
    def open(self, ino: int, caller=None) -> tuple[int, bool]:
        """(handle, direct_io) for a read-only open of `ino` (flags checked by the caller)."""
        if ino < FIRST_DATASET_INODE:
            self.check_file(ino)  # the root and `.dlfs/`: rare, take the long way
            return self.control.open(ino), True
        k, row = self._locate(ino)  # once: this runs for every file a job opens
        if self._dirs[k].is_dir(row):
            raise IsADirError(ino)
        if not self._counting:
            return ino, False
        if caller is None or not self._tracing[0]:
            self.stats.record_open(k, row)
            return ino, False
        started = perf_counter_ns()
        self.stats.record_open(k, row)
        fh = self.trace.open_handle(ino, caller.pid, caller.uid)
        self.trace.record(OP_OPEN, k, row, 0, 0, perf_counter_ns() - started, caller.pid,
                          caller.uid)
        return fh, False

    def read(self, fh: int, offset: int, size: int):
        """Read through an open handle (the daemon answered the open)."""
        if fh >= TRACED_FH:
            if fh >= CONTROL_FH:
                return self.control.read(fh, offset, size)
            ino = handle_inode(fh)
        else:
            ino = fh
        k, row = self._locate(ino)
        if not self._counting:
            return self.readers[k].read(row, offset, size)
        return self._read_counted(k, row, offset, size, fh, None)

    def read_inode(self, ino: int, offset: int, size: int, caller):
        """Read a file the kernel opened without asking us (no handle; FUSE no_open).

        `caller` (.pid, .uid) is the process whose read this is.
        """
        if ino < FIRST_DATASET_INODE:
            self.check_file(ino)
            return self.control.read_latest(ino, caller.pid, offset, size)
        k, row = self._locate(ino)
        if not self._counting:
            return self.readers[k].read(row, offset, size)
        return self._read_counted(k, row, offset, size, 0, caller)

    def _read_counted(self, k: int, row: int, offset: int, size: int, fh: int, caller):
        """Read, count it, and trace it (caller: the reader; None: the handle's opener)."""
        tracing = self._tracing[0]
        if tracing:
            self.stats.request_sources = 0
        started = perf_counter_ns()
        self._requests.begin(k, row, started)
        try:
            data = self.readers[k].read(row, offset, size)
        finally:
            self._requests.end()
        latency = perf_counter_ns() - started
        self.stats.record_read(k, row, offset, len(data), latency)
        if tracing:
            pid, uid = (caller.pid, caller.uid) if caller is not None else self.trace.opener(fh)
            self.trace.record(OP_READ, k, row, offset, len(data), latency, pid, uid,
                              self.stats.request_sources)
        return data

    def release(self, fh: int) -> None:
        if fh >= CONTROL_FH:
            self.control.release(fh)
        elif self._tracing[0]:
            ino = handle_inode(fh) if fh >= TRACED_FH else fh
            k, row = self._locate(ino)
            pid, uid = self.trace.opener(fh)
            self.trace.record(OP_RELEASE, k, row, 0, 0, 0, pid, uid)

    def write_ckpt(self, ino: int, offset: int, data: bytes | memoryview, caller) -> int:
        """A WRITE into the checkpoint subtree, traced like reads while tracing."""
        if not self._tracing[0]:
            return self._ckpt.write(ino, offset, data)
        started = perf_counter_ns()
        n = self._ckpt.write(ino, offset, data)
        self.trace.record(OP_WRITE, CKPT_DATASET, ino & ~CKPT_BIT, offset, n,
                          perf_counter_ns() - started, caller.pid, caller.uid)
        return n

    def count_ckpt_write(self, ino: int, nbytes: int, caller) -> None:
        """A checkpoint file written through FUSE passthrough was closed: the daemon saw
        none of its writes, so it counts (and traces) the file once, with its size."""
        written = self._ckpt.written
        if written is not None:
            written.add(nbytes)
        if self._tracing[0]:
            self.trace.record(OP_WRITE, CKPT_DATASET, ino & ~CKPT_BIT, 0, nbytes, 0,
                              caller.pid, caller.uid)

    def _trace_inode(self, op: int, ino: int, caller, started: int) -> None:
        """Trace a metadata operation on `ino` (dataset -1, row = inode outside datasets)."""
        if FIRST_DATASET_INODE <= ino < self._end:
            k, row = self._locate(ino)
        else:
            k, row = -1, ino
        self.trace.record(op, k, row, 0, 0, perf_counter_ns() - started, caller.pid,
                          caller.uid)


if TYPE_CHECKING:  # the seams the Namespace fills for the FUSE workers (mypy checks them)
    from dlfsd.core.values import CkptCalls, DatasetCalls

    def _serves_datasets(ns: Namespace) -> DatasetCalls:
        return ns

    def _serves_ckpt(ns: Namespace) -> CkptCalls:
        return ns

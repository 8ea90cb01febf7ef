"""Namespace: the mount's tree over one or more datasets, addressed by inode.

Inode 1 is the mount root, whose children are the datasets. Inodes 2..1023
are reserved for control files (`.dlfs/`); dataset k owns the block
[base_k, base_k + rows_k), with inode = base_k + row. Everything here is plain
Python over the SampleDirectory arrays: no pyfuse3, so tests drive it directly.
"""

from __future__ import annotations

import bisect
import stat
import time
from typing import TYPE_CHECKING, NamedTuple

import trio

from dlfs.directory import SampleDirectory
from dlfs.errors import IsADirError, NotADirError, NotFoundError
from dlfs.store import Dataset
from dlfsd.reader import SampleReader
from dlfsd.sources import SourceCounters

if TYPE_CHECKING:
    from dlfsd.pool import ChunkPool

ROOT_INODE = 1
FIRST_DATASET_INODE = 1024
ROOT_MODE = stat.S_IFDIR | 0o555
PRIVATE_ROOT_MODE = stat.S_IFDIR | 0o700  # a mount for one user (dlfs mount --uid)


class Attr(NamedTuple):
    """What getattr/lookup report for an inode (a tuple: built once per entry of readdir)."""

    ino: int
    mode: int
    size: int
    mtime_ns: int
    nlink: int


def _attr(d: SampleDirectory, base: int, row: int) -> Attr:
    mode = d.mode(row)
    nlink = 2 + d.subdir_count(row) if stat.S_ISDIR(mode) else 1
    return Attr(base + row, mode, d.size(row), d.mtime_ns(row), nlink)


class Namespace:
    """Maps inodes to (dataset, row) and answers lookup/getattr/readdir/read."""

    def __init__(self, datasets: list[Dataset], limiter: trio.CapacityLimiter,
                 verify: bool = True, pool: ChunkPool | None = None,
                 counters: SourceCounters | None = None, store_rate: int = 0,
                 root_mode: int = ROOT_MODE) -> None:
        """Datasets are ordered by name; a pool must index them in that order too."""
        self.root_mode = root_mode
        self.datasets = sorted(datasets, key=lambda d: d.name)
        self.readers = [SampleReader(d, limiter, verify, pool=pool, ds_index=i, counters=counters,
                                     store_rate=store_rate)
                        for i, d in enumerate(self.datasets)]
        self._dirs = [d.directory for d in self.datasets]
        self._bases: list[int] = []
        base = FIRST_DATASET_INODE
        for d in self.datasets:
            self._bases.append(base)
            base += len(d.directory)
        self._end = base
        self._by_name = {d.name.encode(): i for i, d in enumerate(self.datasets)}
        self.mounted_ns = time.time_ns()

    def use_inline_io(self) -> None:
        """Switch every reader to blocking I/O in the handler (worker-process mode)."""
        for reader in self.readers:
            reader.inline_io = True

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    # -- inode arithmetic ---------------------------------------------------
    def _locate(self, ino: int) -> tuple[int, int]:
        """(dataset index, row) of a dataset inode; NotFoundError otherwise."""
        if not FIRST_DATASET_INODE <= ino < self._end:
            raise NotFoundError(f"no inode {ino}")
        k = bisect.bisect_right(self._bases, ino) - 1
        return k, ino - self._bases[k]

    # -- metadata -------------------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> int:
        if parent == ROOT_INODE:
            k = self._by_name.get(name)
            if k is None:
                raise NotFoundError(name)
            return self._bases[k]
        k, row = self._locate(parent)
        directory = self._dirs[k]
        if not directory.is_dir(row):
            raise NotADirError(parent)
        child = directory.lookup(row, name)
        if child < 0:
            raise NotFoundError(name)
        return self._bases[k] + child

    def getattr(self, ino: int) -> Attr:
        if ino == ROOT_INODE:
            return Attr(ROOT_INODE, self.root_mode, 0, self.mounted_ns, 2 + len(self.datasets))
        k, row = self._locate(ino)
        return _attr(self._dirs[k], self._bases[k], row)

    def readlink(self, ino: int) -> bytes:
        k, row = self._locate(ino)
        try:
            return self._dirs[k].readlink(row)
        except KeyError:
            raise NotFoundError(f"inode {ino} is not a symlink") from None

    def check_dir(self, ino: int) -> None:
        if ino != ROOT_INODE:
            k, row = self._locate(ino)
            if not self._dirs[k].is_dir(row):
                raise NotADirError(ino)

    def check_file(self, ino: int) -> None:
        if ino == ROOT_INODE:
            raise IsADirError(ino)
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
            return
        k, row = self._locate(ino)
        d, base = self._dirs[k], self._bases[k]
        kids = d.children(row)
        for off in range(start, len(kids)):
            child = kids[off]
            yield d.name(child), _attr(d, base, child), off + 1

    def totals(self) -> tuple[int, int]:
        """(bytes, entries) over all mounted datasets, for statfs."""
        nbytes = sum(int(d.stats["bytes"]) for d in self.datasets)
        return nbytes, self._end - FIRST_DATASET_INODE + 1

    # -- data ------------------------------------------------------------------
    async def read(self, ino: int, offset: int, size: int):
        k, row = self._locate(ino)
        return await self.readers[k].read(row, offset, size)

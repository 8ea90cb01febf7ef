"""Directory listings packed for the FUSE wire in bulk (numpy), for the worker processes.

Why: the first `ls -l`/`os.walk` of a mount is one READDIRPLUS reply per
~6,000 entries (the kernel asks for as much as the lister's getdents buffer,
which glibc sizes by the directory's st_blksize: 1 MiB here, see
dlfsd.core.values.DIR_BLKSIZE), each entry a fuse_entry_out (inode attributes) plus a
fuse_dirent plus the name. Packed one
`struct.pack` at a time in Python that costs ~3.5 µs per entry, as much CPU as
the kernel spends creating the entry's inode and dentry, and the lister waits
for it. A dataset directory's children are contiguous rows of the
SampleDirectory arrays, so a whole reply is a handful of array operations:
fixed-size parts are filled column by column into an (entries x longest
record) byte matrix, names are dropped in with one masked assignment, and a
mask of each record's true length squeezes the matrix into the reply.

Byte layout (include/uapi/linux/fuse.h, little-endian): READDIRPLUS records
are fuse_entry_out (128 bytes) + fuse_dirent (24 bytes) + name, padded to 8;
READDIR records are the fuse_dirent + name only. pack_entries packs the same
records one at a time (dlfsd.fuse.fusewire's layouts), for every other listing:
the root and `.dlfs/` of the datasets' connection, every directory of the
checkpoint connection; the tests check that both agree byte for byte.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterable

import numpy as np

from dlfs.store.directory import SampleDirectory
from dlfsd.core.values import BLKSIZE, DIR_BLKSIZE, Attr, st_blocks
from dlfsd.fuse.fusewire import AttrPacker, dirent

_ENTRY_FIELDS = [
    ("nodeid", "<u8"), ("generation", "<u8"), ("entry_valid", "<u8"), ("attr_valid", "<u8"),
    ("entry_valid_nsec", "<u4"), ("attr_valid_nsec", "<u4"),
    ("ino", "<u8"), ("size", "<u8"), ("blocks", "<u8"),
    ("atime", "<i8"), ("mtime", "<i8"), ("ctime", "<i8"),
    ("atimensec", "<u4"), ("mtimensec", "<u4"), ("ctimensec", "<u4"),
    ("mode", "<u4"), ("nlink", "<u4"), ("uid", "<u4"), ("gid", "<u4"), ("rdev", "<u4"),
    ("blksize", "<u4"), ("flags", "<u4"),
]
_DIRENT_FIELDS = [("d_ino", "<u8"), ("d_off", "<u8"), ("namelen", "<u4"), ("type", "<u4")]
PLUS_RECORD = np.dtype(_ENTRY_FIELDS + _DIRENT_FIELDS)  # 152 bytes, then the name
PLAIN_RECORD = np.dtype(_DIRENT_FIELDS)  # 24 bytes, then the name


def pack_entries(entries: Iterable[tuple[bytes, Attr, int]], size: int,
                 entry_of: Callable[[Attr], bytes] | None) -> bytes:
    """A READDIR reply of `entries` (name, attributes, next offset), one record at a
    time while they fit in `size` bytes; with `entry_of` (READDIRPLUS: an Attr's
    fuse_entry_out) each record carries the entry's attributes too. Both workers' one
    way to list a directory that is not a dataset's."""
    out, used = [], 0
    for name, attr, next_offset in entries:
        entry = dirent(name, attr.ino, attr.mode, next_offset)
        if entry_of is not None:
            entry = entry_of(attr) + entry
        if used + len(entry) > size:
            break
        out.append(entry)
        used += len(entry)
    return b"".join(out)


class ListingPacker:
    """Packs READDIR/READDIRPLUS replies for the directories of one dataset."""

    def __init__(self, directory: SampleDirectory, base: int, attrs: AttrPacker) -> None:
        """`base` is the inode of row 0; `attrs` gives owner and cache timeouts."""
        self.d = directory
        self.base = base
        self.attrs = attrs
        self._name_off = directory.arrays["name_off"]
        self._names = np.frombuffer(directory.names, dtype=np.uint8)

    def pack(self, row: int, start: int, size: int, plus: bool) -> bytes:
        """Entries of directory `row` from index `start` that fit in `size` bytes."""
        kids = self.d.children(row)
        first = kids.start + start
        if first >= kids.stop:
            return b""
        fixed = (PLUS_RECORD if plus else PLAIN_RECORD).itemsize
        # No record is shorter than fixed + 8: never look at more entries than fit.
        last = min(kids.stop, first + size // (fixed + 8))
        name_off = self._name_off[first : last + 1].astype(np.int64)
        name_len = np.diff(name_off)
        rec_len = fixed + ((name_len + 7) & ~7)
        n = int(np.searchsorted(np.cumsum(rec_len), size, side="right"))
        if n == 0:
            return b""
        rows = np.arange(first, first + n)
        name_len, rec_len = name_len[:n], rec_len[:n]
        records = self._records(rows, start, name_len, plus)
        width = int(rec_len.max())
        matrix = np.zeros((n, width), dtype=np.uint8)
        matrix[:, :fixed] = records.view(np.uint8).reshape(n, fixed)
        cols = np.arange(width - fixed)
        names = self._names[name_off[0] : name_off[n]]
        matrix[:, fixed:][cols < name_len[:, None]] = names
        if int(rec_len.min()) == width:  # common: names of one padded length, no squeezing
            return matrix.tobytes()
        return matrix[np.arange(width) < rec_len[:, None]].tobytes()

    def _records(self, rows: np.ndarray, start: int, name_len: np.ndarray,
                 plus: bool) -> np.ndarray:
        """The fixed-size part of each record (entry_out + dirent, or the dirent)."""
        a = self.d.arrays
        mode = a["mode"][rows[0] : rows[-1] + 1].astype(np.uint32)
        ino = rows.astype(np.uint64) + np.uint64(self.base)
        rec = np.zeros(len(rows), dtype=PLUS_RECORD if plus else PLAIN_RECORD)
        rec["d_ino"] = ino
        rec["d_off"] = np.arange(start + 1, start + 1 + len(rows), dtype=np.uint64)
        rec["namelen"] = name_len
        rec["type"] = (mode & stat.S_IFMT(0xFFFF)) >> 12
        if not plus:
            return rec
        p = self.attrs
        size = a["size"][rows[0] : rows[-1] + 1]
        sec, nsec = np.divmod(a["mtime_ns"][rows[0] : rows[-1] + 1], 1_000_000_000)
        rec["nodeid"] = rec["ino"] = ino
        rec["entry_valid"] = rec["attr_valid"] = p.valid
        rec["entry_valid_nsec"] = rec["attr_valid_nsec"] = p.valid_ns
        rec["size"] = size
        rec["blocks"] = st_blocks(size)
        rec["atime"] = rec["mtime"] = rec["ctime"] = sec
        rec["atimensec"] = rec["mtimensec"] = rec["ctimensec"] = nsec
        rec["mode"] = mode
        is_dir = (mode & stat.S_IFMT(0xFFFF)) == stat.S_IFDIR
        rec["nlink"] = self._nlinks(rows, is_dir)
        rec["uid"], rec["gid"] = p.uid, p.gid
        rec["blksize"] = np.where(is_dir, DIR_BLKSIZE, BLKSIZE)
        return rec

    def _nlinks(self, rows: np.ndarray, is_dir: np.ndarray) -> np.ndarray:
        """1 for files and links; 2 + subdirectories for directories (as getattr says)."""
        nlink = np.ones(len(rows), dtype=np.uint32)
        for i in np.flatnonzero(is_dir):
            nlink[i] = 2 + self.d.subdir_count(int(rows[i]))
        return nlink

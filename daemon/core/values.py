"""The read core's values: what the FUSE adapters and the checkpoint tree take from it.

An entry's attributes (Attr), what statfs reports (StatFs), the block sizes the mount
reports, and FileSpan (verified bytes a worker splices instead of copying). Here,
apart from the Namespace and the SampleReader, so that the adapters and the tree
need only these plain types, not the code that makes them; and the shapes of the
Namespace the FUSE workers call (DatasetCalls, CkptCalls: Protocols, which the
Namespace fills, checked by mypy).
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from dlfs.store.directory import SampleDirectory

BLKSIZE = 128 * 1024  # st_blksize of files
#: st_blksize of a directory. glibc sizes its getdents buffer by it (up to 1 MiB), and the
#: kernel asks for READDIRPLUS replies that large: a directory of a few thousand samples is
#: listed in one round trip to the daemon instead of one per ~750 entries (128 KiB).
DIR_BLKSIZE = 1 << 20


def st_blocks(size):
    """512-byte blocks of a file of `size` bytes (an int, or a numpy array of sizes)."""
    return (size + 511) // 512


def st_blksize(mode: int) -> int:
    """The preferred I/O size the mount reports for an entry of `mode`."""
    return DIR_BLKSIZE if stat.S_ISDIR(mode) else BLKSIZE


class StatFs(NamedTuple):
    """What statfs reports: the datasets' size in 4 KiB blocks, nothing free."""

    blocks: int
    files: int
    bsize: int = 4096
    frsize: int = 4096
    bfree: int = 0
    bavail: int = 0
    ffree: int = 0
    namemax: int = 255


class Attr(NamedTuple):
    """What getattr/lookup report for an inode (a tuple: built once per entry of readdir)."""

    ino: int
    mode: int
    size: int
    mtime_ns: int
    nlink: int


class FileSpan:
    """Verified bytes left where they are: `length` bytes at `pos` of descriptor `fd`.

    What a read returns instead of the bytes when its caller asked for spans
    (SampleReader.use_spans): worker processes splice such a span from the chunk
    file into their FUSE reply, so the bytes never pass through user memory. One
    object per reader, reused by every read (workers serve one request at a time).
    """

    __slots__ = ("fd", "length", "pos")

    def __init__(self) -> None:
        self.fd = self.pos = self.length = 0

    def __len__(self) -> int:
        return self.length

    def set(self, fd: int, pos: int, length: int) -> FileSpan:
        self.fd, self.pos, self.length = fd, pos, length
        return self


class Caller(Protocol):
    """Who sent a request (dlfsd.fuse.requestloop.Caller): what the trace records."""

    @property
    def pid(self) -> int: ...

    @property
    def uid(self) -> int: ...


class DatasetCalls(Protocol):
    """What the datasets' FUSE workers (dlfsd.fuse.wireworker) call of the read core
    (dlfsd.core.namespace.Namespace): one call per request. A read returns bytes, or
    a FileSpan once use_spans allowed them."""

    def use_spans(self, max_length: int) -> None: ...

    def lookup(self, parent: int, name: bytes, caller: Caller | None = None) -> int: ...

    def getattr(self, ino: int, caller: Caller | None = None) -> Attr: ...

    def control_attr(self, ino: int, pid: int) -> Attr: ...

    def readlink(self, ino: int) -> bytes: ...

    def check_dir(self, ino: int) -> None: ...

    def readdir(self, ino: int, start: int) -> Iterator[tuple[bytes, Attr, int]]: ...

    def dataset_directory(self, ino: int) -> tuple[SampleDirectory, int, int] | None: ...

    def statfs(self) -> StatFs: ...

    def is_control(self, ino: int) -> bool: ...

    def check_open(self, ino: int, flags: int) -> None: ...

    def check_access(self, ino: int, mode: int) -> None: ...

    def getxattr(self, ino: int, name: bytes) -> bytes: ...

    def listxattr(self, ino: int) -> list[bytes]: ...

    def refuse_change(self, request: str) -> None: ...

    def open(self, ino: int, caller: Caller | None = None) -> tuple[int, bool]: ...

    def read(self, fh: int, offset: int,
             size: int) -> bytes | bytearray | memoryview | FileSpan: ...

    def read_inode(self, ino: int, offset: int, size: int,
                   caller: Caller) -> bytes | bytearray | memoryview | FileSpan: ...

    def release(self, fh: int) -> None: ...


class CkptCalls(Protocol):
    """What the checkpoint connection's workers (dlfsd.fuse.ckptworker) call of the
    Namespace: the writes it counts and traces."""

    def write_ckpt(self, ino: int, offset: int, data: bytes | memoryview,
                   caller: Caller) -> int: ...

    def count_ckpt_write(self, ino: int, nbytes: int, caller: Caller) -> None: ...

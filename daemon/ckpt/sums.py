"""Extent checksums of the checkpoint store's copies: written by the drain, checked by
reads of those copies (a placeholder's reads, and the copy-back before a write).

Why: the drain checks the store's copy once, when it publishes it (read back and
compared). A restart reads it days later, maybe on another node, after the store's
disks, network and caches had their chance to change bits. Datasets check each extent
on its first read from a copy (dlfsd.core.reader); checkpoint reads from the store do the
same here, with xxh3-64 per EXTENT bytes computed by the drain from the bytes it read
from the local copy.

Where: `DIR/.dlfs-sums/<st_ino>-<st_size>-<st_mtime_ns>`, one file per published copy,
named by the store copy's identity as the drain stats it before its rename into place
(a rename keeps the inode, so the tree's rename mirroring needs no change here). A
reader finds the sums with the fstat of the descriptor it reads through, so a copy
replaced since (another node's drain), put there by hand, or on a store that does not
keep inode numbers simply has none, and is read unchecked. Content: a header (magic,
version, extent size, file size) and the digests as little-endian u64.

Sums are an optimisation of trust, not of correctness: the drain publishes a copy
even when its sums cannot be written. Orphans (a store file removed by hand) are
left; the tree removes the sums of a copy it removes or replaces on the store.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import time

import xxhash

from dlfs.errors import CorruptDataError
from dlfsd.ckpt.beneath import Beneath
from dlfsd.ckpt.tier import tmp_name

log = logging.getLogger("dlfsd")

EXTENT = 4 << 20  # bytes per checksum: one read from the store checks one extent
SUMS_DIR = b".dlfs-sums"  # at the store's root; never shown in ckpt/
MAGIC = b"DLFSCKS\0"
VERSION = 1
_HEADER = struct.Struct("<8sIIQ")  # magic, version, extent size, file size
UNCHECKED, LOADING, CHECKED = 0, 1, 2  # one byte per extent, shared by the workers
LOADING_WAIT = 2.0  # seconds a worker waits for another's check before doing its own


def extents_of(size: int) -> int:
    return -(-size // EXTENT)


def sums_path(st: os.stat_result) -> bytes:
    """Where the sums of store copy `st` are, relative to the store (its identity:
    inode, size, mtime)."""
    return SUMS_DIR + b"/%d-%d-%d" % (st.st_ino, st.st_size, st.st_mtime_ns)


class ExtentHasher:
    """xxh3-64 of each EXTENT of a stream of bytes fed in pieces of any length."""

    def __init__(self) -> None:
        self.digests: list[int] = []
        self._hasher = xxhash.xxh3_64()
        self._filled = 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), EXTENT - self._filled)
            self._hasher.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == EXTENT:
                self.digests.append(self._hasher.intdigest())
                self._hasher.reset()
                self._filled = 0

    def finish(self) -> list[int]:
        """The digests, the last (partial) extent's included."""
        if self._filled:
            self.digests.append(self._hasher.intdigest())
            self._hasher.reset()
            self._filled = 0
        return self.digests


def write(store: Beneath, st: os.stat_result, digests: list[int]) -> None:
    """Write the sums of store copy `st` (atomically: a hidden temporary beside, fsynced,
    renamed; a drain cut short leaves a temporary the next mount removes, as it does
    its copies'), as the store's user. Raises OSError; ValueError if `digests` do not
    cover `st`."""
    if len(digests) != extents_of(st.st_size):
        raise ValueError(f"{len(digests)} checksums for {st.st_size} bytes")
    target = sums_path(st)
    with contextlib.suppress(FileExistsError):
        store.mkdir(SUMS_DIR, 0o755)
    tmp = SUMS_DIR + b"/" + tmp_name(os.path.basename(target))
    data = _HEADER.pack(MAGIC, VERSION, EXTENT, st.st_size) + b"".join(
        d.to_bytes(8, "little") for d in digests)
    fd = store.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)  # a crash must not leave a named file of zeros: false EIOs
        finally:
            os.close(fd)
        store.rename(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            store.unlink(tmp)
        raise


def remove(store: Beneath, st: os.stat_result | None) -> None:
    """Remove the sums of store copy `st` (removed or replaced), if it has any."""
    if st is not None and (st.st_mode & 0o170000) == 0o100000:
        with contextlib.suppress(OSError):
            store.unlink(sums_path(st))


class ExtentCheck:
    """The sums of one store copy, and the state of each of its extents (UNCHECKED,
    LOADING, CHECKED): one byte per extent in a file mapped by every worker process
    that reads the copy (`checked_dir/<identity>`), so an extent is read from the
    store and hashed once per copy and mount, not once per worker (the kernel's
    read-ahead spreads one file's reads over all of them); per process if that file
    cannot be made."""

    __slots__ = ("digests", "size", "state", "what")

    def __init__(self, digests: bytes, size: int, what: str, state) -> None:
        self.digests = digests
        self.size = size
        self.state = state  # mmap or bytearray of extents_of(size) bytes
        self.what = what  # for the log: the file's path in ckpt/

    def matches(self, index: int, data) -> bool:
        """`data` is extent `index` as the drain read it."""
        want = min(EXTENT, self.size - index * EXTENT)
        return len(data) == want and xxhash.xxh3_64_intdigest(data) == int.from_bytes(
            self.digests[index * 8:index * 8 + 8], "little")


def load(store: Beneath, st: os.stat_result, what: str,
         checked_dir: bytes | None = None) -> ExtentCheck | None:
    """The sums of store copy `st` (fstat of the descriptor it is read through); None
    if it has none (read unchecked). A sums file that is not one (another version,
    cut short, a symlink, larger than any copy's sums could be) is logged (WARNING,
    once per process) and ignored. `checked_dir`: where the extents' states are shared
    with the other workers (None: this process only)."""
    limit = _HEADER.size + 8 * extents_of(st.st_size)
    try:
        fd = store.open(sums_path(st), os.O_RDONLY)
        try:
            data = os.read(fd, limit + 1)  # the user writes the store: never more
        finally:
            os.close(fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        _warn_once(("load", err.errno), "checkpoint checksums of %s cannot be read (%s); "
                   "read unchecked", what, err.strerror)
        return None
    if len(data) >= _HEADER.size:
        magic, version, extent, size = _HEADER.unpack_from(data)
        if (magic, version, extent, size) == (MAGIC, VERSION, EXTENT, st.st_size) \
                and len(data) == _HEADER.size + 8 * extents_of(size):
            return ExtentCheck(data[_HEADER.size:], size, what,
                               _shared_state(checked_dir, st, extents_of(size)))
    _warn_once(("bad", None), "checkpoint checksums %s are not in a known form; %s is "
               "read unchecked", store.display(sums_path(st)), what)
    return None


def _shared_state(checked_dir: bytes | None, st: os.stat_result, count: int):
    """`count` bytes shared with every process mapping the same store copy's file in
    `checked_dir` (made zero, UNCHECKED, by the first); a private bytearray if none."""
    if checked_dir is None or count == 0:
        return bytearray(count)
    try:
        fd = os.open(os.path.join(checked_dir, os.path.basename(sums_path(st))),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size != count:
                os.ftruncate(fd, count)  # every process asks for the same size
            return mmap.mmap(fd, count)
        finally:
            os.close(fd)
    except OSError as err:
        _warn_once(("state", err.errno), "checked checkpoint extents cannot be shared "
                   "between workers (%s); each worker checks them itself", err.strerror)
        return bytearray(count)


_warned: set = set()


def _warn_once(key, message: str, *args) -> None:
    level = logging.DEBUG if key in _warned else logging.WARNING
    _warned.add(key)
    log.log(level, message, *args)


def read_full(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `fd` at `offset` (short reads of a network file system go on);
    returns the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class CheckedReads:
    """Reads of store copies that have sums, for one process (a CkptTree): the first
    read touching an extent reads the whole extent into one buffer (EXTENT bytes, made
    at the first such read and reused), checks it, and answers from it; later reads of
    that extent are answered from the buffer while it holds it (a sequential reader
    reads the store once), of another checked extent (by any worker) by a plain
    pread. A worker whose read touches an extent another one is checking waits for
    its result (LOADING_WAIT at most: a worker that died leaves LOADING behind)."""

    def __init__(self) -> None:
        self._buf: bytearray | None = None
        self._view: memoryview | None = None
        self._held: ExtentCheck | None = None  # whose extent the buffer holds
        self._held_index = -1
        self._bad: set[str] = set()  # files whose mismatch was logged at WARNING

    def read(self, fd: int, check: ExtentCheck, offset: int, size: int) -> bytes | memoryview:
        """`size` bytes at `offset`, checked. From the held extent, a view of this
        process's buffer (no copy): valid until its next read, and the reply is written
        before that."""
        end = min(offset + size, check.size)
        if offset >= end:
            return os.pread(fd, size, offset)  # at or past the end: nothing to check
        first, last = offset // EXTENT, (end - 1) // EXTENT
        if not self._holds(check, first, last):
            state = check.state
            for index in range(first, last + 1):
                if state[index] != CHECKED:
                    self._verify(fd, check, index)
            if not self._holds(check, first, last):
                return os.pread(fd, size, offset)
        base = first * EXTENT
        return self._buffer()[offset - base:end - base]

    def _buffer(self) -> memoryview:
        """The extent buffer, made at the first check (most workers never check)."""
        if self._view is None:
            self._buf = bytearray(EXTENT)
            self._view = memoryview(self._buf)
        return self._view

    def _holds(self, check: ExtentCheck, first: int, last: int) -> bool:
        """The buffer holds the one extent [first, last] of `check`'s copy."""
        return first == last and self._held is check and self._held_index == first

    def _verify(self, fd: int, check: ExtentCheck, index: int) -> None:
        state = check.state
        if state[index] == LOADING and _wait_for_other(state, index):
            return
        view = self._buffer()
        self._held = None
        state[index] = LOADING
        try:
            start = index * EXTENT
            want = min(EXTENT, check.size - start)
            n = read_full(fd, view[:want], start)
            if not check.matches(index, view[:n]):
                raise self.mismatch(check, index)
            state[index] = CHECKED
            self._held, self._held_index = check, index
        finally:
            if state[index] == LOADING:
                state[index] = UNCHECKED

    def mismatch(self, check: ExtentCheck, index: int) -> CorruptDataError:
        """The error for a bad extent, logged at WARNING once per file and process."""
        start = index * EXTENT
        level = logging.DEBUG if check.what in self._bad else logging.WARNING
        self._bad.add(check.what)
        log.log(level, "checkpoint %s: bytes %d-%d (extent %d) of the store's copy do not "
                "match the checksum its drain wrote; reads of them fail with EIO (copy the "
                "file to the store again from a good copy, or remove it)", check.what,
                start, min(start + EXTENT, check.size), index)
        return CorruptDataError(f"checksum mismatch: {check.what}, extent {index}")


def _wait_for_other(state, index: int) -> bool:
    """Another worker checks extent `index`: wait for it; True if it found it good."""
    deadline = time.monotonic() + LOADING_WAIT
    while state[index] == LOADING:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return state[index] == CHECKED

"""Copy the extents of a planned dataset into its chunk files: the hot loop of populate.

The plan (dlfs.store.layout) fixes where every extent goes, so the copying is cut
into *tasks*: runs of consecutive extents of one chunk, at most TASK_BYTES and
TASK_EXTENTS long. A task is read into one reused buffer and lands in its
chunk file with one pwrite at its planned offset, so tasks need no order and any
process can do any of them. The bytes are those of a serial copy (docs/FORMAT.md).

Why processes and not threads: for tiny files the work is per file Python calls
(open, read, fstat, close, checksum) that hold the GIL, so threads ran one at a
time. `jobs` worker processes (dlfs.store.workers) are forked once; each gets
task numbers over a pipe and answers with one short message per task (the
checksums go straight into a shared anonymous mapping). One worker (or one
task) runs inline, no fork.

Why files are opened ahead: reading a file that is not cached waits for the
disk, one file at a time. A worker opens up to AHEAD files of its task and asks
the kernel to read them all (posix_fadvise WILLNEED, which starts the reads and
returns) before it reads the first; the disk then has many reads in flight.

Why directory descriptors: each file is opened by its name relative to its
directory, opened in turn one name at a time from the source root with
O_NOFOLLOW. A directory swapped for a symbolic link while packing cannot lead
outside the tree (its opening fails), and the kernel looks up one name per file
instead of the whole path. A file must still be the one the scan saw: a regular
file of the same size and mtime (fstat after the read), and not longer (the last
extent asks for one byte more).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from dlfs.errors import DlfsError
from dlfs.progress import byte_progress
from dlfs.store.directory import SampleDirectory, chunk_lengths, display_path
from dlfs.store.format import (
    CHUNK_DIR,
    CHUNK_HEADER_SIZE,
    MAX_EXTENT_SIZE,
    chunk_filename,
    pack_chunk_header,
)
from dlfs.store.workers import worker_pool

# A task: consecutive extents of one chunk whose starts lie in one TASK_BYTES window
# of it (so at most TASK_BYTES + one extent of data), at most TASK_EXTENTS of them.
TASK_BYTES = 8 << 20
TASK_EXTENTS = 1024
# Files of a task opened and announced to the kernel before the first is read.
AHEAD = 64
# Directory descriptors a worker keeps open (rows of one directory are contiguous).
DIR_FDS = 32

# Never blocks on a fifo swapped in since the scan; no effect on regular files.
SOURCE_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Tasks:
    """The copying cut into tasks, in extent order: task i is extents first[i]:end[i]."""

    first: np.ndarray  # int64
    end: np.ndarray  # int64
    chunk: np.ndarray  # int64
    nbytes: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.first)


def plan_tasks(directory: SampleDirectory, chunks: np.ndarray | None = None) -> Tasks:
    """Cut the extents (of the chunks marked in `chunks`, if given) into tasks."""
    ext_chunk = directory.arrays["ext_chunk"].astype(np.int64)
    ext_offset = directory.arrays["ext_offset"].astype(np.int64)
    ext_end = ext_offset + directory.arrays["ext_length"]
    n = len(ext_chunk)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Tasks(empty, empty, empty, empty)
    index = np.arange(n, dtype=np.int64)
    starts = np.ones(n, dtype=bool)
    starts[1:] = ((ext_chunk[1:] != ext_chunk[:-1])
                  | (ext_offset[1:] // TASK_BYTES != ext_offset[:-1] // TASK_BYTES)
                  | (index[1:] % TASK_EXTENTS == 0))
    first = np.flatnonzero(starts)
    end = np.append(first[1:], n).astype(np.int64)
    chunk = ext_chunk[first]
    if chunks is not None:
        keep = chunks[chunk]
        first, end, chunk = first[keep], end[keep], chunk[keep]
    nbytes = ext_end[end - 1] - ext_offset[first]
    return Tasks(first, end, chunk, nbytes)


def copy_extents(source: Path, tmp: Path, directory: SampleDirectory, dataset_uuid: bytes,
                 jobs: int, fsync: bool, progress: bool | None,
                 chunks: np.ndarray | None = None) -> np.ndarray:
    """Write the chunk files (only those marked in `chunks`, if given) under `tmp`; return
    the extent checksums (zero for extents of chunks not written)."""
    tasks = plan_tasks(directory, chunks)
    shared = mmap.mmap(-1, max(8, 8 * directory.extent_count))  # MAP_SHARED: forks write it
    try:
        copier = ExtentCopier(os.fsencode(os.path.realpath(source)),
                              os.fsencode(tmp / CHUNK_DIR), directory, tasks, shared)
        _run_tasks(copier, tasks, directory, dataset_uuid, jobs, fsync, progress,
                   f"packing {source}")
        return np.frombuffer(shared, dtype=np.uint64, count=directory.extent_count).copy()
    finally:
        shared.close()


def _run_tasks(copier: ExtentCopier, tasks: Tasks, directory: SampleDirectory,
               dataset_uuid: bytes, jobs: int, fsync: bool, progress: bool | None,
               description: str) -> None:
    """Hand out the tasks in order, create each chunk file before its first task and
    finish it (header done, fsync in the background) after its last."""
    workers = min(jobs, len(tasks))
    left = np.bincount(tasks.chunk, minlength=len(chunk_lengths(directory)))
    # Fork first: no threads yet (progress bar, fsyncs) to be copied half-way.
    with worker_pool(copier, workers) as pool, \
            ChunkFiles(copier.chunk_dir, dataset_uuid, chunk_lengths(directory), fsync) as files, \
            byte_progress(description, int(tasks.nbytes.sum()), progress) as advance:
        chunk_of, nbytes = tasks.chunk.tolist(), tasks.nbytes.tolist()
        sent = done = 0
        while done < len(tasks):
            while sent < len(tasks) and pool.has_room():
                if sent == 0 or chunk_of[sent] != chunk_of[sent - 1]:
                    files.create(chunk_of[sent])
                pool.submit(sent, sent)
                sent += 1
            for task, _ in pool.finished():
                done += 1
                advance(nbytes[task])
                chunk = chunk_of[task]
                left[chunk] -= 1
                if left[chunk] == 0:
                    files.finish(chunk)
        files.close()


class ExtentCopier:
    """Does tasks: reads their extents from the source, checksums them, writes them to
    their chunk file. Made before the fork; `start` in the process that does the tasks."""

    def __init__(self, root: bytes, chunk_dir: bytes, directory: SampleDirectory,
                 tasks: Tasks, checksums: mmap.mmap) -> None:
        self.root = root
        self.chunk_dir = chunk_dir
        self.directory = directory
        self.tasks = tasks
        self._checksums = checksums
        arrays = directory.arrays
        self.ext_start = arrays["ext_start"]
        counts = np.diff(self.ext_start)
        self.ext_row = np.repeat(np.arange(len(counts), dtype=np.uint32), counts)
        self._buffer: memoryview | None = None
        self._sums: memoryview | None = None
        self._dirs: DirectoryFds | None = None
        self._chunk = -1
        self._chunk_fd = -1

    def start(self) -> None:
        # One extent may start just before the end of a task's window; +1: the byte
        # that shows a file grew.
        self._buffer = memoryview(bytearray(TASK_BYTES + MAX_EXTENT_SIZE + 1))
        self._sums = memoryview(self._checksums).cast("B").cast("Q")
        self._dirs = DirectoryFds(self.root, self.directory)

    def stop(self) -> None:
        if self._chunk_fd >= 0:
            os.close(self._chunk_fd)
            self._chunk_fd, self._chunk = -1, -1
        if self._dirs is not None:
            self._dirs.close()
            self._dirs = None
        if self._sums is not None:
            self._sums.release()
            self._sums = None

    def run(self, task: int) -> None:
        """Copy one task: source errors raise DlfsError, store errors OSError."""
        first, end = int(self.tasks.first[task]), int(self.tasks.end[task])
        total = self._read(first, end)
        self._write(int(self.tasks.chunk[task]), first, total)

    def _read(self, first: int, end: int) -> int:
        """Read extents first:end back to back into the buffer, checksum each; returns the
        bytes read. Per-file values come from numpy once per task, as plain ints."""
        d = self.directory
        arrays = d.arrays
        index = np.arange(first, end, dtype=np.uint32)
        rows = self.ext_row[first:end]
        starts = self.ext_start[rows]
        file_offsets = ((index - starts).astype(np.int64) * d.extent_size).tolist()
        is_last = (self.ext_start[rows + 1] == index + 1).tolist()
        lengths = arrays["ext_length"][first:end].tolist()
        sizes = arrays["size"][rows].tolist()
        mtimes = arrays["mtime_ns"][rows].tolist()
        parents = d.parents(rows).tolist()
        name_off = arrays["name_off"]
        name_lo = name_off[rows].tolist()
        name_hi = name_off[rows + 1].tolist()
        row_list = rows.tolist()
        names = d.names
        buf, sums, dirs = self._buffer, self._sums, self._dirs
        assert buf is not None and sums is not None and dirs is not None
        os_open, fadvise, preadv, fstat, close = (os.open, os.posix_fadvise, os.preadv,
                                                 os.fstat, os.close)
        willneed = os.POSIX_FADV_WILLNEED
        digest = xxhash.xxh3_64_intdigest
        n = end - first
        pos = 0
        for group in range(0, n, AHEAD):
            stop = min(n, group + AHEAD)
            fds: list[int] = []
            try:
                parent, dir_fd = -1, -1
                for k in range(group, stop):
                    if parents[k] != parent:
                        parent = parents[k]
                        dir_fd = dirs.fd(parent)
                    try:
                        fd = os_open(names[name_lo[k]:name_hi[k]], SOURCE_OPEN_FLAGS,
                                     dir_fd=dir_fd)
                    except OSError as err:
                        raise self._source_error(row_list[k], err.strerror) from None
                    fds.append(fd)
                    try:  # noqa: SIM105 - suppress() costs a call per file
                        fadvise(fd, file_offsets[k], lengths[k], willneed)
                    except OSError:  # a hint; a fifo swapped in says ESPIPE (caught below)
                        pass
                for j, k in enumerate(range(group, stop)):
                    fd, length = fds[j], lengths[k]
                    want = length + 1 if is_last[k] else length
                    try:
                        got = preadv(fd, [buf[pos:pos + want]], file_offsets[k])
                        while 0 < got < length:  # a network file system may return less
                            more = preadv(fd, [buf[pos + got:pos + want]],
                                          file_offsets[k] + got)
                            if not more:
                                break
                            got += more
                        st = fstat(fd)  # after the read: a rewrite during it shows
                    except OSError as err:
                        self._check_unchanged(fd, row_list[k])
                        raise self._source_error(row_list[k], err.strerror) from None
                    fds[j] = -1
                    close(fd)
                    if (got != length or st.st_size != sizes[k] or st.st_mtime_ns != mtimes[k]
                            or not stat.S_ISREG(st.st_mode)):
                        raise self._changed(row_list[k])
                    sums[first + k] = digest(buf[pos:pos + length])
                    pos += length
            finally:
                for fd in fds:
                    if fd >= 0:
                        close(fd)
        return pos

    def _write(self, chunk: int, first: int, total: int) -> None:
        if chunk != self._chunk:
            if self._chunk_fd >= 0:
                os.close(self._chunk_fd)
                self._chunk_fd, self._chunk = -1, -1
            self._chunk_fd = os.open(os.path.join(self.chunk_dir,
                                                  os.fsencode(chunk_filename(chunk))),
                                     os.O_WRONLY | os.O_CLOEXEC)
            self._chunk = chunk
        assert self._buffer is not None
        at = CHUNK_HEADER_SIZE + int(self.directory.arrays["ext_offset"][first])
        done = 0
        while done < total:
            wrote = os.pwrite(self._chunk_fd, self._buffer[done:total], at + done)
            if wrote == 0:
                raise OSError(errno.EIO, "short write", chunk_filename(chunk))
            done += wrote

    def _path(self, row: int) -> bytes:
        return os.path.join(self.root, self.directory.path(row))

    def _check_unchanged(self, fd: int, row: int) -> None:
        st = os.fstat(fd)
        d = self.directory
        if not stat.S_ISREG(st.st_mode) or st.st_size != d.size(row) \
                or st.st_mtime_ns != d.mtime_ns(row):
            raise self._changed(row)

    def _source_error(self, row: int, why: str) -> DlfsError:
        return DlfsError(f"cannot read source file {display_path(self._path(row))}: {why}")

    def _changed(self, row: int) -> DlfsError:
        return DlfsError(f"source file changed while packing: {display_path(self._path(row))}; "
                         "re-run populate once the source is stable")


class DirectoryFds:
    """Descriptors of source directories by row, opened one name at a time from the root
    with O_NOFOLLOW, the last DIR_FDS used kept open."""

    def __init__(self, root: bytes, directory: SampleDirectory) -> None:
        self.root = root
        self.directory = directory
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise DlfsError(f"cannot read source {display_path(root)}: {err.strerror}") from None
        self._root_fd = root_fd
        self._open: OrderedDict[int, int] = OrderedDict()

    def fd(self, row: int) -> int:
        if row == 0:
            return self._root_fd
        fd = self._open.get(row)
        if fd is not None:
            self._open.move_to_end(row)
            return fd
        way = []  # rows from `row` up to the first one open (or the root)
        at = row
        while at != 0 and at not in self._open:
            way.append(at)
            at = self.directory.parent(at)
        fd = self._root_fd if at == 0 else self._open[at]
        for at in reversed(way):
            try:
                fd = os.open(self.directory.name(at), _DIR_OPEN_FLAGS, dir_fd=fd)
            except OSError as err:
                raise self._error(at, err) from None
            self._open[at] = fd
            while len(self._open) > DIR_FDS:
                os.close(self._open.popitem(last=False)[1])
        return fd

    def _error(self, row: int, err: OSError) -> DlfsError:
        path = display_path(os.path.join(self.root, self.directory.path(row)))
        if err.errno in (errno.ENOTDIR, errno.ELOOP):
            return DlfsError(f"source directory {path} now leads outside its planned place "
                             "(it was replaced by a symbolic link or a file while packing); "
                             "re-run populate once the source is stable")
        if err.errno == errno.ENOENT:
            return DlfsError(f"source directory {path} was deleted while packing; re-run "
                             "populate once the source is stable")
        return DlfsError(f"cannot read source directory {path}: {err.strerror}")

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()
        os.close(self._root_fd)


class ChunkFiles:
    """The chunk files being written: created with their final header before their first
    task, fsynced in a background thread after their last (so durability overlaps the
    copying instead of adding to it); close() waits and raises the first failure."""

    def __init__(self, chunk_dir: bytes, dataset_uuid: bytes, lengths: np.ndarray,
                 fsync: bool) -> None:
        self.chunk_dir = chunk_dir
        self.uuid = dataset_uuid
        self.lengths = lengths
        self.fsync = fsync
        self._fds: dict[int, int] = {}
        self._syncer: ThreadPoolExecutor | None = None
        self._syncing: list[Future] = []

    def __enter__(self) -> ChunkFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def create(self, index: int) -> None:
        path = os.path.join(self.chunk_dir, os.fsencode(chunk_filename(index)))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self._fds[index] = fd
        header = pack_chunk_header(index, int(self.lengths[index]), self.uuid)
        if os.pwrite(fd, header, 0) != len(header):
            raise OSError(errno.EIO, "short write", os.fsdecode(path))

    def finish(self, index: int) -> None:
        fd = self._fds.pop(index)
        if not self.fsync:
            os.close(fd)
            return
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(2, thread_name_prefix="dlfs-fsync")
        self._syncing.append(self._syncer.submit(_sync_and_close, fd))

    def close(self) -> None:
        """Wait for every fsync; the first failure (a full disk shows up here) raises."""
        try:
            for future in self._syncing:
                future.result()
        finally:
            self.abort()

    def abort(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._syncer is not None:
            self._syncer.shutdown(wait=True, cancel_futures=True)
            self._syncer = None


def _sync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

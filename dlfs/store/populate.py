"""`dlfs populate`: pack a source tree into a new dataset in the store.

Scan -> plan (pure arithmetic, dlfs.store.layout) -> read pieces with N parallel
readers (sources live on slow parallel file systems, where one reader is
latency-bound) -> append them to chunk files in plan order -> write the
manifest -> publish by one rename. Any failure removes the temporary
directory; a killed process leaves only a dot-named leftover that the next
populate of the same name on this host cleans.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlfs.errors import DlfsError, UsageError
from dlfs.progress import byte_progress
from dlfs.store.directory import SampleDirectory, chunk_lengths, display_path
from dlfs.store.format import (
    CHUNK_DIR,
    DEFAULT_CHUNK_SIZE,
    MANIFEST_NAME,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    checksum,
    chunk_filename,
    encode_manifest,
    pack_chunk_header,
)
from dlfs.store.scan import check_source, scan_tree
from dlfs.store.store import Dataset, Store, check_dataset_name, fsync_path, manifest_body

log = logging.getLogger(__name__)

# Bytes and pieces read ahead of the writer; bound memory whatever the file sizes.
READ_WINDOW = 256 << 20
PIECES_PER_READER = 64


@dataclass(frozen=True)
class PopulateOptions:
    chunk_size: int = DEFAULT_CHUNK_SIZE
    jobs: int = 4
    force: bool = False
    fsync: bool = True
    progress: bool | None = None  # None: only when stderr is a terminal


@dataclass(frozen=True)
class Piece:
    """One extent to copy: `length` bytes at `offset` of source file `path`."""

    path: bytes  # absolute, under the source root with its symlinks resolved
    offset: int
    length: int
    is_last: bool
    size: int  # the file's size and mtime at the scan: a file that differs has changed
    mtime_ns: int


def check_options(options: PopulateOptions) -> None:
    if not MIN_CHUNK_SIZE <= options.chunk_size <= MAX_CHUNK_SIZE:
        raise UsageError(f"--chunk-size must be between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} "
                         f"bytes, got {options.chunk_size}")
    if options.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {options.jobs}")


@dataclass(frozen=True)
class PopulatePlan:
    """Everything decided before any byte is copied: the tree, its chunk layout, the
    temporary directory. Pure data, so MPI rank 0 can hand it to the others."""

    source: Path
    name: str
    directory: SampleDirectory  # checksums still zero
    dataset_uuid: bytes
    stats: dict
    tmp: Path


def populate(source: Path, store: Store, name: str, options: PopulateOptions) -> Dataset:
    """Pack `source` into `store` as dataset `name`; return the published dataset."""
    plan = plan_populate(source, store, name, options)
    try:
        start_temp_dir(plan)
        checksums = write_chunks(source, plan.tmp, plan.directory, plan.dataset_uuid, options)
        publish_dataset(store, plan, checksums, options)
    except OSError as err:
        shutil.rmtree(plan.tmp, ignore_errors=True)
        raise store_error(err, store) from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (the CLI turns it into this)
        shutil.rmtree(plan.tmp, ignore_errors=True)
        raise KeyboardInterrupt(interrupted_outcome(store, plan)) from None
    except BaseException:
        shutil.rmtree(plan.tmp, ignore_errors=True)
        raise
    return store.open(name)


def interrupted_outcome(store: Store, plan: PopulatePlan) -> str:
    """What an interrupted populate leaves: the rename that publishes may have happened
    just before (the old dataset's deletion after it takes a while)."""
    try:
        published = store.open(plan.name).uuid == plan.dataset_uuid
    except DlfsError:
        published = False
    return f"dataset {plan.name!r} was published" if published else "nothing was published"


def plan_populate(source: Path, store: Store, name: str, options: PopulateOptions) -> PopulatePlan:
    """Check the arguments, scan the source and lay out the dataset (nothing written yet)."""
    check_options(options)
    check_dataset_name(name)
    check_source(source)
    _check_store_outside(store, source)
    _check_store_writable(store)
    store.clean_stale_temps(name)  # first: it may put back a dataset a killed run moved
    store.check_replaceable(name)
    if store.exists(name) and not options.force:
        raise DlfsError(f"dataset {name!r} already exists in {store.path} "
                        "(use --force to replace it)")
    if store.exists(name):
        store.check_unmounted(name, "replace")

    scan = scan_tree(source)
    if scan.skipped:
        log.warning("skipped %d special files (sockets, fifos, devices): %s",
                    len(scan.skipped), _some_paths(scan.skipped))
    if scan.vanished:
        log.warning("%d entries were deleted while the source was scanned and are not "
                    "packed: %s", len(scan.vanished), _some_paths(scan.vanished))
    directory = scan.directory(options.chunk_size)
    stats = _stats(directory, len(scan.skipped),
                   display_path(os.fsencode(os.path.abspath(source))))
    # The temp dir is named before it exists, so cleanup never misses it.
    return PopulatePlan(source, name, directory, uuid.uuid4().bytes, stats,
                        store.temp_dir_path(name))


def _check_store_outside(store: Store, source: Path) -> None:
    """A store inside its source would be packed into the dataset (the chunk files
    being written, and every dataset populated there before)."""
    if store.path.resolve().is_relative_to(source.resolve()):
        raise DlfsError(f"store {store.path} is inside the source {source}: the dataset "
                        "would pack the store itself; put the store outside the source")


def _some_paths(paths: list[bytes], shown: int = 10) -> str:
    text = ", ".join(display_path(p) for p in paths[:shown])
    return text + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def start_temp_dir(plan: PopulatePlan) -> None:
    plan.tmp.mkdir()
    (plan.tmp / CHUNK_DIR).mkdir()


def publish_dataset(store: Store, plan: PopulatePlan, checksums: np.ndarray,
                    options: PopulateOptions) -> None:
    """Write the manifest next to the finished chunks and publish by one rename."""
    if options.force and store.exists(plan.name):  # again: the copy may have taken hours
        store.check_unmounted(plan.name, "replace")
    directory = plan.directory.with_checksums(checksums)
    body = manifest_body(plan.name, plan.dataset_uuid, options.chunk_size,
                         chunk_lengths(directory), directory, plan.stats)
    _write_file(plan.tmp / MANIFEST_NAME, encode_manifest(body), options.fsync)
    if options.fsync:
        fsync_path(plan.tmp / CHUNK_DIR)
        fsync_path(plan.tmp)
    store.publish(plan.tmp, plan.name, replace=options.force)


def _check_store_writable(store: Store) -> None:
    try:
        store.path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DlfsError(f"store {store.path} is not a directory (check --store)") from None
    except OSError as err:
        raise DlfsError(f"cannot create store {store.path}: {err.strerror}") from None
    if not os.access(store.path, os.W_OK | os.X_OK):
        raise DlfsError(f"store is not writable: {store.path} (check its permissions)")


def store_error(err: OSError, store: Store) -> DlfsError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DlfsError(f"store is full: {store.path} ({err.strerror}); nothing was published, "
                         "free space or use another --store")
    where = f": {err.filename}" if err.filename else ""
    return DlfsError(f"cannot write to store {store.path} ({err.strerror}{where}); "
                     "nothing was published")


def _stats(directory: SampleDirectory, skipped: int, source: str) -> dict:
    kinds = directory.arrays["mode"] & 0o170000
    files = kinds == stat.S_IFREG
    return {
        "files": int(np.count_nonzero(files)),
        "dirs": int(np.count_nonzero(kinds == stat.S_IFDIR)),
        "symlinks": int(np.count_nonzero(kinds == stat.S_IFLNK)),
        "bytes": int(directory.arrays["size"][files].sum()),
        "skipped": skipped,
        "source": source,
    }


def plan_pieces(source: Path, directory: SampleDirectory,
                wanted: np.ndarray | None = None) -> Iterator[Piece]:
    """Every extent of every file (only those `wanted[ext]`, if given), in extent order,
    with the source path to read it from."""
    root = os.fsencode(os.path.realpath(source))  # what /proc/self/fd shows (_check_inside)
    ext_size = directory.extent_size
    lengths = directory.ext_length_view
    for row in directory.file_rows().tolist():
        extents = directory.extents(row)
        if not extents or (wanted is not None and not wanted[extents.start:extents.stop].any()):
            continue
        path = os.path.join(root, directory.path(row))
        size, mtime = directory.size(row), directory.mtime_ns(row)
        for i, ext in enumerate(extents):
            if wanted is None or wanted[ext]:
                yield Piece(path, i * ext_size, lengths[ext], ext == extents.stop - 1,
                            size, mtime)


# Never blocks on a fifo swapped in since the scan; no effect on regular files.
_SOURCE_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def read_piece(piece: Piece) -> tuple[bytes, int]:
    """Read one extent from the source and checksum it (runs in a reader thread).

    The file must still be the one the scan saw: a regular file inside the source
    tree with the same size and mtime. Otherwise a tree changed under us (or a user
    who can write to it swapping a directory for a symlink) would have populate
    pack bytes the scan never listed, from outside the tree.
    """
    try:
        fd = os.open(piece.path, _SOURCE_OPEN_FLAGS)
    except OSError as err:
        raise _source_error(piece, err.strerror) from None
    try:
        _check_inside(fd, piece)
        # One byte more on the last piece tells us the file grew since the scan.
        want = piece.length + (1 if piece.is_last else 0)
        try:
            data = _pread_full(fd, want, piece.offset, piece.length)
        finally:  # after the read (a rewrite during it shows), and on a fifo's ESPIPE too
            _check_unchanged(fd, piece)
    except OSError as err:  # a source problem, not the store's (which OSErrors elsewhere mean)
        raise _source_error(piece, err.strerror) from None
    finally:
        os.close(fd)
    if len(data) != piece.length:
        raise _changed(piece)
    return data, checksum(data)


def _check_unchanged(fd: int, piece: Piece) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != piece.size \
            or st.st_mtime_ns != piece.mtime_ns:
        raise _changed(piece)


def _check_inside(fd: int, piece: Piece) -> None:
    """The opened file's path must be the planned one: O_NOFOLLOW guards only the last
    name, so a directory on the way replaced by a symlink would lead elsewhere."""
    try:
        opened = os.readlink(b"/proc/self/fd/%d" % fd)
    except OSError:  # no /proc: nothing to compare with
        return
    if opened != piece.path and not _same_file_in_place(fd, piece):
        raise DlfsError(f"source file {display_path(piece.path)} now leads outside its "
                        f"planned place (to {display_path(opened)}): a directory on its path "
                        "was replaced while packing; re-run populate once the source is stable")


def _same_file_in_place(fd: int, piece: Piece) -> bool:
    """The path shown differs only in spelling (a case-insensitive file system shows
    the name as first looked up): the opened file is the one at the planned path now,
    and no directory on the way is a symlink."""
    try:
        here = os.stat(piece.path, follow_symlinks=False)
    except FileNotFoundError:
        raise _changed(piece) from None  # deleted since we opened it
    except OSError:
        return False
    opened = os.fstat(fd)
    directory = os.path.dirname(piece.path)
    return (opened.st_dev, opened.st_ino) == (here.st_dev, here.st_ino) \
        and os.path.realpath(directory) == directory


def _pread_full(fd: int, length: int, pos: int, enough: int) -> bytes:
    """Up to `length` bytes, at least `enough` unless the file ends first: a network
    file system may return less than asked without being at the end. (The last piece
    asks one byte past the scanned end; getting `enough` there costs no second call.)"""
    data = os.pread(fd, length, pos)
    if len(data) >= enough or not data:
        return data
    parts = [data]
    got = len(data)
    while got < enough:
        more = os.pread(fd, length - got, pos + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _source_error(piece: Piece, why: str) -> DlfsError:
    return DlfsError(f"cannot read source file {display_path(piece.path)}: {why}")


def _changed(piece: Piece) -> DlfsError:
    return DlfsError(f"source file changed while packing: {display_path(piece.path)}; "
                     "re-run populate once the source is stable")


def write_chunks(source: Path, tmp: Path, directory: SampleDirectory, dataset_uuid: bytes,
                 options: PopulateOptions, chunks: np.ndarray | None = None) -> np.ndarray:
    """Copy every extent into chunk files under `tmp`; return the extent checksums.

    With `chunks` (a bool mask over chunk indices) only those chunks are written
    and only their extents' checksums are set (the others stay zero): how MPI
    ranks share the work.
    """
    checksums = np.zeros(directory.extent_count, dtype=np.uint64)
    lengths = directory.arrays["ext_length"]
    if chunks is None:
        wanted, todo = None, range(directory.extent_count)
        total = int(lengths.sum(dtype=np.uint64))
    else:
        wanted = chunks[directory.arrays["ext_chunk"]]
        todo = np.flatnonzero(wanted).tolist()
        total = int(lengths[wanted].sum(dtype=np.uint64))
    writer = ChunkWriter(tmp / CHUNK_DIR, dataset_uuid, options.fsync)
    pieces = plan_pieces(source, directory, wanted)
    chunk_of = directory.ext_chunk_view
    window: deque[tuple[Future, int]] = deque()
    max_pieces = options.jobs * PIECES_PER_READER
    in_flight = 0
    with ThreadPoolExecutor(options.jobs, thread_name_prefix="dlfs-reader") as pool, \
            byte_progress(f"packing {source}", total, options.progress) as advance:
        try:
            for ext in todo:
                while not window or (in_flight < READ_WINDOW
                                     and len(window) < max_pieces):
                    piece = next(pieces, None)
                    if piece is None:
                        break
                    window.append((pool.submit(read_piece, piece), piece.length))
                    in_flight += piece.length
                future, length = window.popleft()
                in_flight -= length
                data, checksums[ext] = future.result()
                writer.append(chunk_of[ext], data)
                advance(length)
            writer.close()
        finally:
            for future, _ in window:
                future.cancel()
            writer.abort()
    return checksums


class ChunkWriter:
    """Appends extents to chunk files in order; finishes each chunk's header on switch.

    A finished chunk is fsynced in a background thread while the next one is
    written, so durability costs overlap instead of adding up; close() waits
    for all of them and raises the first failure (a full disk shows up here).
    """

    def __init__(self, chunk_dir: Path, dataset_uuid: bytes, fsync: bool) -> None:
        self.chunk_dir = chunk_dir
        self.uuid = dataset_uuid
        self.fsync = fsync
        self.index = -1
        self.file = None
        self.length = 0
        self._syncer = ThreadPoolExecutor(2, thread_name_prefix="dlfs-fsync")
        self._syncing: list[Future] = []

    def append(self, index: int, data: bytes) -> None:
        if index != self.index:
            self._finish()
            self.index = index
            self.file = open(self.chunk_dir / chunk_filename(index), "wb")  # noqa: SIM115
            self.file.write(pack_chunk_header(index, 0, self.uuid))
            self.length = 0
        self.file.write(data)
        self.length += len(data)

    def _finish(self) -> None:
        if self.file is None:
            return
        self.file.seek(0)
        self.file.write(pack_chunk_header(self.index, self.length, self.uuid))
        self.file.flush()
        file, self.file = self.file, None
        if self.fsync:
            self._syncing.append(self._syncer.submit(_sync_and_close, file))
        else:
            file.close()

    def close(self) -> None:
        self._finish()
        try:
            for future in self._syncing:
                future.result()
        finally:
            self._syncer.shutdown(wait=True)

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self._syncer.shutdown(wait=True, cancel_futures=True)


def _sync_and_close(file) -> None:
    try:
        os.fsync(file.fileno())
    finally:
        file.close()


def _write_file(path: Path, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())

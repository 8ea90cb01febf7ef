"""Walk a source tree into the columns of a sample directory, byte-exact and without
following links.

Names are handled as raw bytes end to end, so names that are not valid UTF-8
survive packing. Symlinks are recorded as links (never followed, so nothing
outside the tree is ever read); sockets, fifos and devices cannot be packed
and are reported back to the caller, who warns once.

The walk visits directories breadth-first and lists each one sorted by name
bytes: the very order of the sample directory's rows (docs/FORMAT.md). So every
listing is appended once to flat columns (dlfs.store.directory.TreeColumns),
with no Python object per entry and no second pass to sort a million entries
into place.

Listing a directory (one lstat per entry, relative to the directory's
descriptor) is the per-entry cost, and on a cold cache or a parallel file system
each lstat waits for the disk or the metadata server. So directories are listed
by `jobs` forked workers (dlfs.store.workers) as soon as their rows are known,
and their listings are appended in row order as they come back: the result is
the same whatever the number of workers.
"""

from __future__ import annotations

import errno
import os
import stat
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from dlfs.errors import DlfsError, NotFoundError
from dlfs.store.directory import SampleDirectory, TreeColumns, assemble_directory, display_path
from dlfs.store.workers import worker_pool

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass
class ScanResult:
    columns: TreeColumns
    skipped: list[bytes] = field(default_factory=list)  # relpaths of special files
    vanished: list[bytes] = field(default_factory=list)  # deleted while we scanned
    file_count: int = 0
    total_bytes: int = 0

    def directory(self, chunk_size: int) -> SampleDirectory:
        """The scanned tree as a sample directory with its chunk layout (checksums zero)."""
        return assemble_directory(self.columns, chunk_size)


@dataclass
class Listing:
    """One directory's entries that become rows, sorted by name, as flat columns (what a
    worker sends back: a few bytes objects, not an object per entry)."""

    names: bytes = b""
    name_len: bytes = b""  # array("Q")
    mode: bytes = b""  # array("H")
    size: bytes = b""  # array("Q")
    mtime_ns: bytes = b""  # array("q")
    dirs: list[tuple[int, bytes]] = field(default_factory=list)  # (index, name)
    links: list[tuple[int, bytes]] = field(default_factory=list)  # (index, target)
    skipped: list[bytes] = field(default_factory=list)  # names
    vanished: list[bytes] = field(default_factory=list)  # names
    files: int = 0
    file_bytes: int = 0

    @property
    def count(self) -> int:
        return len(self.mode) // 2


def check_source(source: Path) -> os.stat_result:
    """Stat the source root; one clear error if it is missing or not a directory."""
    try:
        root_stat = os.stat(source)
    except FileNotFoundError:
        raise NotFoundError(f"source not found: {source}") from None
    except OSError as err:
        raise DlfsError(f"cannot read source {source}: {err.strerror}") from None
    if not stat.S_ISDIR(root_stat.st_mode):
        raise DlfsError(f"source is not a directory: {source}")
    return root_stat


def scan_tree(source: Path, jobs: int = 1) -> ScanResult:
    """List every entry under `source` (which must be a readable directory), with `jobs`
    processes listing directories."""
    root_stat = check_source(source)
    columns = TreeColumns()
    columns.append(b"", root_stat.st_mode, 0, root_stat.st_mtime_ns)
    result = ScanResult(columns)
    dir_rows = [0]  # directories to list, in row order: breadth-first
    dir_rels = [b""]
    listed: dict[int, Listing] = {}  # by index into dir_rows, until its turn comes
    sent = appended = 0
    with worker_pool(DirectoryLister(source), jobs) as pool:
        while appended < len(dir_rows):
            while sent < len(dir_rows) and pool.has_room():
                pool.submit(sent, dir_rels[sent])
                sent += 1
            for index, listing in pool.finished():
                listed[index] = listing
            while appended in listed:
                _append(result, dir_rows[appended], dir_rels[appended], listed.pop(appended),
                        dir_rows, dir_rels)
                dir_rels[appended] = b""  # listed: keep no path per directory
                appended += 1
    return result


def _append(result: ScanResult, row: int, rel_dir: bytes, listing: Listing,
            dir_rows: list[int], dir_rels: list[bytes]) -> None:
    """A directory's listing becomes the next rows (its children), in one go per column."""
    columns = result.columns
    first = len(columns)
    count = listing.count
    columns.child_count[row] = count
    columns.names += listing.names
    columns.name_len.frombytes(listing.name_len)
    columns.child_count.frombytes(bytes(8 * count))
    columns.mode.frombytes(listing.mode)
    columns.size.frombytes(listing.size)
    columns.mtime_ns.frombytes(listing.mtime_ns)
    for index, target in listing.links:
        columns.link_rows.append(first + index)
        columns.links += target
        columns.link_len.append(len(target))
    for index, name in listing.dirs:
        dir_rows.append(first + index)
        dir_rels.append(_join(rel_dir, name))
    result.skipped += (_join(rel_dir, name) for name in listing.skipped)
    result.vanished += (_join(rel_dir, name) for name in listing.vanished)
    result.file_count += listing.files
    result.total_bytes += listing.file_bytes


class DirectoryLister:
    """Lists one directory per request (its path relative to the source root)."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.root = os.fsencode(source)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def run(self, rel_dir: bytes) -> Listing:
        abs_dir = os.path.join(self.root, rel_dir) if rel_dir else self.root
        try:
            fd, names = _open_and_list(abs_dir, self.root, rel_dir)
        except FileNotFoundError:
            if not rel_dir:
                raise NotFoundError(f"source not found: {self.source}") from None
            return Listing()  # removed since its parent was listed: packed as empty
        except OSError as err:
            raise DlfsError(
                f"cannot list source directory {display_path(abs_dir)}: {err.strerror}; "
                "fix its permissions or exclude it"
            ) from None
        try:
            names.sort()
            return _list(fd, abs_dir, names)
        finally:
            os.close(fd)


def _open_and_list(abs_dir: bytes, root: bytes, rel_dir: bytes) -> tuple[int, list[bytes]]:
    """(descriptor, names) of a source directory. A path longer than PATH_MAX (a deep
    tree) cannot be opened whole: it is then opened one component at a time, as the
    copy does and as the mount serves it (every lookup is one name)."""
    try:
        fd = os.open(abs_dir, _DIR_FLAGS)
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG:
            raise
        fd = _open_by_components(root, rel_dir)
        try:
            return fd, [os.fsencode(name) for name in os.listdir(fd)]
        except BaseException:
            os.close(fd)
            raise
    try:
        return fd, os.listdir(abs_dir)
    except BaseException:
        os.close(fd)
        raise


def _open_by_components(root: bytes, rel_dir: bytes) -> int:
    """Open root/rel_dir by walking it name by name, following no symlink on the way."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in rel_dir.split(b"/"):
            parent, fd = fd, -1
            try:
                fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
            finally:
                os.close(parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def _list(fd: int, abs_dir: bytes, names: list[bytes]) -> Listing:
    """The hot loop: one lstat and a few appends per entry."""
    listing = Listing()
    blob = bytearray()
    name_len, mode_col, size_col, mtime_col = array("Q"), array("H"), array("Q"), array("q")
    lstat = os.lstat
    kept = 0
    for name in names:
        try:
            st = lstat(name, dir_fd=fd)
        except FileNotFoundError:  # deleted between listing and stat: not in the tree
            listing.vanished.append(name)
            continue
        except OSError as err:
            raise DlfsError(f"cannot stat source entry "
                            f"{display_path(os.path.join(abs_dir, name))}: "
                            f"{err.strerror}") from None
        mode = st.st_mode
        kind = mode & 0o170000
        size = st.st_size
        if kind == stat.S_IFREG:
            listing.files += 1
            listing.file_bytes += size
        elif kind == stat.S_IFDIR:
            listing.dirs.append((kept, name))
            size = 0
        elif kind == stat.S_IFLNK:
            try:
                target = os.readlink(name, dir_fd=fd)
            except FileNotFoundError:
                listing.vanished.append(name)
                continue
            except OSError as err:  # EINVAL: no longer a link
                raise DlfsError(f"cannot read source symlink "
                                f"{display_path(os.path.join(abs_dir, name))}: "
                                f"{err.strerror}") from None
            listing.links.append((kept, target))
        else:
            listing.skipped.append(name)
            continue
        blob += name
        name_len.append(len(name))
        mode_col.append(mode)
        size_col.append(size)
        mtime_col.append(st.st_mtime_ns)
        kept += 1
    listing.names = bytes(blob)
    listing.name_len = name_len.tobytes()
    listing.mode = mode_col.tobytes()
    listing.size = size_col.tobytes()
    listing.mtime_ns = mtime_col.tobytes()
    return listing


def _join(rel_dir: bytes, name: bytes) -> bytes:
    return rel_dir + b"/" + name if rel_dir else name

"""Walk a source tree into the columns of a sample directory, byte-exact and without
following links.

Names are handled as raw bytes end to end, so names that are not valid UTF-8
survive packing. Symlinks are recorded as links (never followed, so nothing
outside the tree is ever read); sockets, fifos and devices cannot be packed
and are reported back to the caller, who warns once.

The walk visits directories breadth-first and lists each one sorted by name
bytes: the very order of the sample directory's rows (docs/FORMAT.md). So every
entry is appended once to flat columns (dlfs.store.directory.TreeColumns), with
no Python object per entry and no second pass to sort a million entries into
place. Each entry costs one lstat relative to its directory's descriptor: a
lookup of one name, not of the whole path again.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from dlfs.errors import DlfsError, NotFoundError
from dlfs.store.directory import SampleDirectory, TreeColumns, assemble_directory, display_path

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


def scan_tree(source: Path) -> ScanResult:
    """List every entry under `source` (which must be a readable directory)."""
    root = os.fsencode(source)
    root_stat = check_source(source)
    columns = TreeColumns()
    columns.append(b"", root_stat.st_mode, 0, root_stat.st_mtime_ns)
    result = ScanResult(columns)
    dir_rows = [0]  # directories still to list, in row order: breadth-first
    dir_rels = [b""]
    i = 0
    while i < len(dir_rows):
        row, rel_dir = dir_rows[i], dir_rels[i]
        dir_rels[i] = b""  # listed: keep no path per directory for the rest of the walk
        i += 1
        abs_dir = os.path.join(root, rel_dir) if rel_dir else root
        try:
            names, fd = _list(abs_dir)
        except FileNotFoundError:
            if not rel_dir:
                raise NotFoundError(f"source not found: {source}") from None
            continue  # removed since its parent was listed: packed as an empty directory
        except OSError as err:
            raise DlfsError(
                f"cannot list source directory {display_path(abs_dir)}: {err.strerror}; "
                "fix its permissions or exclude it"
            ) from None
        try:
            columns.child_count[row] = _add_children(result, fd, abs_dir, rel_dir, names,
                                                     dir_rows, dir_rels)
        finally:
            os.close(fd)
    return result


def _list(abs_dir: bytes) -> tuple[list[bytes], int]:
    """The names in a directory, sorted by bytes, and a descriptor of it to stat them by."""
    fd = os.open(abs_dir, _DIR_FLAGS)
    try:
        names = os.listdir(abs_dir)
    except BaseException:
        os.close(fd)
        raise
    names.sort()
    return names, fd


def _add_children(result: ScanResult, fd: int, abs_dir: bytes, rel_dir: bytes,
                  names: list[bytes], dir_rows: list[int], dir_rels: list[bytes]) -> int:
    """Append a directory's entries (the hot loop: one lstat and a few appends each);
    returns how many became rows."""
    columns = result.columns
    lstat = os.lstat
    kept = 0
    for name in names:
        try:
            st = lstat(name, dir_fd=fd)
        except FileNotFoundError:  # deleted between listing and stat: not in the tree
            result.vanished.append(_join(rel_dir, name))
            continue
        except OSError as err:
            raise DlfsError(f"cannot stat source entry "
                            f"{display_path(os.path.join(abs_dir, name))}: "
                            f"{err.strerror}") from None
        mode = st.st_mode
        kind = mode & 0o170000
        if kind == stat.S_IFREG:
            columns.append(name, mode, st.st_size, st.st_mtime_ns)
            result.file_count += 1
            result.total_bytes += st.st_size
        elif kind == stat.S_IFDIR:
            dir_rows.append(columns.append(name, mode, 0, st.st_mtime_ns))
            dir_rels.append(_join(rel_dir, name))
        elif kind == stat.S_IFLNK:
            try:
                target = os.readlink(name, dir_fd=fd)
            except FileNotFoundError:
                result.vanished.append(_join(rel_dir, name))
                continue
            except OSError as err:  # EINVAL: no longer a link
                raise DlfsError(f"cannot read source symlink "
                                f"{display_path(os.path.join(abs_dir, name))}: "
                                f"{err.strerror}") from None
            columns.append(name, mode, st.st_size, st.st_mtime_ns, target)
        else:
            result.skipped.append(_join(rel_dir, name))
            continue
        kept += 1
    return kept


def _join(rel_dir: bytes, name: bytes) -> bytes:
    return rel_dir + b"/" + name if rel_dir else name

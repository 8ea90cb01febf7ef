"""Walk a source tree into SourceEntry records, byte-exact and without following links.

Names are handled as raw bytes end to end, so names that are not valid UTF-8
survive packing. Symlinks are recorded as links (never followed, so nothing
outside the tree is ever read); sockets, fifos and devices cannot be packed
and are reported back to the caller, who warns once.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from dlfs.errors import DlfsError, NotFoundError
from dlfs.store.directory import SourceEntry, display_path


@dataclass
class ScanResult:
    entries: list[SourceEntry]
    skipped: list[bytes] = field(default_factory=list)  # relpaths of special files
    vanished: list[bytes] = field(default_factory=list)  # deleted while we scanned
    file_count: int = 0
    total_bytes: int = 0


def _entry(relpath: bytes, st: os.stat_result, link_target: bytes | None = None) -> SourceEntry:
    size = st.st_size if not stat.S_ISDIR(st.st_mode) else 0
    return SourceEntry(relpath, st.st_mode, size, st.st_mtime_ns, link_target)


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

    result = ScanResult(entries=[_entry(b"", root_stat)])
    pending = [b""]
    while pending:
        rel_dir = pending.pop()
        abs_dir = os.path.join(root, rel_dir) if rel_dir else root
        try:
            with os.scandir(abs_dir) as it:
                dirents = list(it)
        except FileNotFoundError:
            if not rel_dir:
                raise NotFoundError(f"source not found: {source}") from None
            continue  # removed since its parent was listed: packed as an empty directory
        except OSError as err:
            raise DlfsError(
                f"cannot list source directory {display_path(abs_dir)}: {err.strerror}; "
                "fix its permissions or exclude it"
            ) from None
        for dirent in dirents:
            rel = rel_dir + b"/" + dirent.name if rel_dir else dirent.name
            try:
                _add(result, pending, rel, dirent)
            except FileNotFoundError:  # deleted between listing and stat: not in the tree
                result.vanished.append(rel)
            except OSError as err:
                raise DlfsError(f"cannot stat source entry {display_path(dirent.path)}: "
                                f"{err.strerror}") from None
    return result


def _add(result: ScanResult, pending: list[bytes], rel: bytes, dirent: os.DirEntry) -> None:
    st = dirent.stat(follow_symlinks=False)
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        result.entries.append(_entry(rel, st))
        pending.append(rel)
    elif stat.S_ISREG(mode):
        result.entries.append(_entry(rel, st))
        result.file_count += 1
        result.total_bytes += st.st_size
    elif stat.S_ISLNK(mode):
        result.entries.append(_entry(rel, st, os.readlink(dirent.path)))
    else:
        result.skipped.append(rel)

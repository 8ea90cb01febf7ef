"""A node's chunk cache dir as a whole: which datasets it holds, when each was last
used, which are in use now, and pruning (`dlfs cache ls|prune`).

The cache dir outlives jobs and is shared by the node's daemons (deploy/slurm).
It has no index to update (and so none to lose under concurrent jobs): each
dataset's copies live in a directory named by the dataset's uuid, and two
small files in it say the rest:

- `.last-used`: its mtime is when a mount last started or stopped using the
  dataset (touched by the daemon, `mark_in_use` and `touch_last_used`);
- `.in-use`: every daemon using the dataset holds a shared flock on it while
  it runs (released by the kernel however the daemon ends). Pruning takes the
  exclusive lock without waiting, so it never removes copies a mount uses,
  and a mount starting meanwhile waits the moment the removal takes.
- `.dataset`: JSON `{"name", "path"}`, the dataset the copies are of, as the
  last mount to use them named it (rewritten by `mark_in_use`): `dlfs cache ls`
  names datasets with it where no --store is given. A uuid is one version of a
  dataset: an old version keeps the name it had.

Checkpoint tiers (`ckpt/<key>/`, dlfsd.ckpt.tier, docs/CKPT.md) share the cache
dir: the local copies of what jobs wrote into MOUNTPOINT/ckpt/, and what an
epilog could not drain to the checkpoint store stays there for an admin. They
are never pruned, by `dlfs cache prune` or by --node-cache-limit (the only copy
of a checkpoint may be there), but they take room on the disk: both count the
bytes they hold (`ckpt_tiers`), so chunk copies make way for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from dlfs.procs import daemon_configs

LAST_USED = ".last-used"
IN_USE = ".in-use"
ABOUT = ".dataset"
CKPT_DIR = "ckpt"  # dlfsd.ckpt.tier.TIER_DIR
_UUID_DIR = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class CachedDataset:
    uuid: str  # hex: the directory's name
    path: Path
    chunks: int  # staged copies (chunk files)
    bytes: int
    last_used: float  # epoch seconds; 0: never recorded
    in_use: bool
    name: str | None = None  # as its last mount named it (.dataset); None: not recorded
    source: str | None = None  # the dataset's directory in its store, likewise


def is_dataset_dir(entry: os.DirEntry) -> bool:
    return bool(_UUID_DIR.fullmatch(entry.name)) and entry.is_dir(follow_symlinks=False)


def mark_in_use(directory: Path, name: str | None = None, source: str | None = None) -> int:
    """Take the shared `.in-use` lock for a mount's lifetime and note the use (and,
    given them, the dataset's name and directory in its store); returns the
    descriptor to keep open (closing it, or the process ending, releases it)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if name is not None:
        _write_about(directory, {"name": name, "path": source})
    fd = os.open(directory / IN_USE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a prune removes this dataset
    except BaseException:
        os.close(fd)
        raise
    touch_last_used(directory)
    return fd


def touch_last_used(directory: Path) -> None:
    with contextlib.suppress(OSError):  # a full or read-only disk must not fail a mount
        (directory / LAST_USED).touch(mode=0o600)
        os.utime(directory / LAST_USED)


def _write_about(directory: Path, about: dict) -> None:
    """Write `.dataset` whole (a temporary name, then rename: a concurrent `ls` reads
    the old or the new); never fails a mount (a full or read-only disk)."""
    temp = directory / f"{ABOUT}.{os.getpid()}"
    with contextlib.suppress(OSError):
        if _read_about(directory) == about:
            return
        temp.write_text(json.dumps(about))
        os.chmod(temp, 0o600)
        os.rename(temp, directory / ABOUT)
    with contextlib.suppress(OSError):
        temp.unlink()


def _read_about(directory: Path) -> dict:
    """`.dataset` of a dataset directory; {} where missing or unreadable."""
    try:
        about = json.loads((directory / ABOUT).read_text())
    except (OSError, ValueError):
        return {}
    return about if isinstance(about, dict) else {}


def datasets(root: Path) -> list[CachedDataset]:
    """Every dataset directory under a cache dir, least recently used first."""
    try:
        entries = [e for e in os.scandir(root) if is_dataset_dir(e)]
    except FileNotFoundError:
        return []
    found = [_describe(Path(e.path)) for e in entries]
    return sorted(found, key=lambda d: (d.last_used, d.uuid))


def _describe(path: Path) -> CachedDataset:
    chunks = nbytes = 0
    with contextlib.suppress(OSError), os.scandir(path) as files:
        for f in files:
            if not f.name.startswith(".") and f.is_file(follow_symlinks=False):
                chunks += f.name.endswith(".chunk")  # not whole-file copies (passthrough)
                nbytes += f.stat(follow_symlinks=False).st_size
    try:
        last_used = (path / LAST_USED).stat().st_mtime
    except OSError:
        last_used = 0.0
    about = _read_about(path)
    name, source = about.get("name"), about.get("path")
    return CachedDataset(path.name, path, chunks, nbytes, last_used, _locked(path),
                         name if isinstance(name, str) else None,
                         source if isinstance(source, str) else None)


def _locked(path: Path) -> bool:
    """Whether some daemon holds the dataset's `.in-use` lock now."""
    try:
        fd = os.open(path / IN_USE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove(dataset: CachedDataset) -> bool:
    """Remove a dataset's copies unless a mount uses them now; True if removed."""
    fd = os.open(dataset.path / IN_USE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(dataset.path, ignore_errors=True)
        return not dataset.path.exists()
    finally:
        os.close(fd)


def select_for_pruning(found: list[CachedDataset], *, uuids: set[str] | None = None,
                       older_than: float | None = None, to_size: int | None = None,
                       now: float | None = None) -> list[CachedDataset]:
    """Which datasets a prune removes, least recently used first, never one in use:
    those named, those unused for `older_than` seconds, then more (LRU) until the
    cache holds at most `to_size` bytes."""
    now = time.time() if now is None else now
    free = [d for d in found if not d.in_use]
    chosen = [d for d in free if (uuids is not None and d.uuid in uuids)
              or (older_than is not None and now - d.last_used >= older_than)]
    if to_size is not None:
        left = sum(d.bytes for d in found) - sum(d.bytes for d in chosen)
        for d in free:
            if left <= to_size:
                break
            if d not in chosen:
                chosen.append(d)
                left -= d.bytes
    return chosen


@dataclass(frozen=True)
class CkptTier:
    """A checkpoint tier in a cache dir (never pruned: see the module doc)."""

    path: Path  # CACHE_DIR/ckpt/<key>
    store: str  # the checkpoint store it drains to ("" if its `store` file is gone)
    files: int
    bytes: int  # on disk, its database too (an evicted file is a hole: it takes nothing)
    undrained: int | None  # files whose bytes the store lacks; None: no readable ledger
    last_used: float  # newest mtime in it (epoch seconds)
    in_use: bool  # a live daemon on this node mounts it


def ckpt_tiers(root: Path) -> list[CkptTier]:
    """Every checkpoint tier under cache dir `root`, least recently used first."""
    try:
        entries = [e for e in os.scandir(root / CKPT_DIR) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    mounted = _mounted_ckpt_stores(root)
    found = [_describe_tier(Path(e.path), mounted) for e in entries]
    return sorted(found, key=lambda t: (t.last_used, t.path.name))


def ckpt_bytes(root: Path) -> int:
    """What the checkpoint tiers under `root` take on disk (a walk; no ledger, no
    process table: what --node-cache-limit needs at every mount)."""
    return _disk_bytes(root / CKPT_DIR)


def _disk_bytes(top: Path) -> int:
    """Blocks the regular files under `top` take (an evicted checkpoint is a hole)."""
    total = 0
    for directory, _, names in os.walk(top):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(directory, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_blocks * 512
    return total


def _describe_tier(path: Path, mounted: set[str]) -> CkptTier:
    try:
        store = (path / "store").read_text().strip()
    except OSError:
        store = ""
    tree = os.fsencode(path / "tree")
    newest = 0.0
    seen: dict[int, tuple[int, int, bytes]] = {}  # the tree's files
    for directory, _, names in os.walk(tree):
        for name in names:
            full = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                st = os.lstat(full)
                if stat.S_ISREG(st.st_mode):
                    newest = max(newest, st.st_mtime)
                    seen[st.st_ino] = (st.st_size, st.st_mtime_ns, full[len(tree) + 1:])
    return CkptTier(path, store, len(seen), _disk_bytes(path),
                    _undrained(path / "state.db", seen), newest,
                    bool(store) and store in mounted)


def _undrained(db: Path, files: dict[int, tuple[int, int, bytes]]) -> int | None:
    """How many of `files` (ino -> size, mtime_ns, relative path) the store lacks, by
    the tier's ledger (dlfsd.ckpt.state's `drained` table; the drain's own rule in
    dlfsd.ckpt.drain.scan: a file whose size, mtime or path differs is not drained)."""
    if not files:
        return 0
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return None
    try:
        ledger = {ino: (size, mtime, bytes(rel)) for ino, size, mtime, rel in
                  conn.execute("SELECT ino, size, mtime_ns, relpath FROM drained")}
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    return sum(1 for ino, row in files.items() if ledger.get(ino) != row)


def _mounted_ckpt_stores(root: Path) -> set[str]:
    """Real paths of the checkpoint stores live daemons on this node mount with cache
    dir `root` (from the process table: taking a tier's lock to look could make a
    mount starting at that moment fail)."""
    real_root = os.path.realpath(root)
    found = set()
    for _, config in daemon_configs():
        cache, store = config.get("cache_dir"), config.get("ckpt_store")
        if isinstance(cache, str) and isinstance(store, str) \
                and os.path.realpath(cache) == real_root:
            found.add(os.path.realpath(store))
    return found

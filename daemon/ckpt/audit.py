"""Audit: may a checkpoint tier be deleted? Read-only, from the tier's own ledger.

The Slurm epilog (and the prolog's failure path, and `DLFS_CACHE_AFTER_JOB=wipe`)
removes node caches. A tier (`CACHE/ckpt/<key>/`, dlfsd.ckpt.tier) may hold the only
copy of a job's checkpoint: whether a mount still exists says nothing about that (a
daemon killed mid-job leaves no mount and undrained files). So the decision comes
from the tier itself:

- in use: its `.lock` is flock-held (a live mount holds it for its lifetime), tried
  with LOCK_EX|LOCK_NB on a descriptor of our own and released at once;
- undrained: a regular file of `tree/` whose inode has a `pending` row, or no
  `drained` row, or whose drained row's (size, mtime_ns, relpath) is not the local
  file's (the same test as the daemon's scan, dlfsd.ckpt.drain.scan); an evicted
  file (rows in `drained` and `evicted`) is on the store by definition;
- unknown: the ledger (`state.db`, opened read-only) or the tree cannot be read:
  the caller keeps the tier.

Nothing here writes: the database is opened with `mode=ro`, the tree is walked by
descriptors (os.fwalk) without following a link, and `.lock` is opened without
O_CREAT. Only the tier's layout is shared with the daemon (dlfsd.ckpt.tier): `dlfs
ckpt-audit` runs this as root on a node with no mount and no daemon.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import sqlite3
import stat
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from dlfsd.ckpt.tier import TIER_DIR, is_adopt_temporary, tier_path

DRAINED, UNDRAINED, IN_USE, UNKNOWN = "drained", "undrained", "in-use", "unknown"
_KEY = re.compile(r"^[0-9a-f]{16}$")  # tier_path's directory names
NAMES_SHOWN = 5  # undrained files named in the one-line report


@dataclass
class TierAudit:
    """What the audit found in one tier; `verdict` is what the caller acts on."""

    root: Path
    in_use: bool = False
    undrained: list[bytes] = field(default_factory=list)  # relpaths in the tree
    undrained_bytes: int = 0
    files: int = 0  # regular files seen
    why_unknown: str = ""  # set: the ledger or the tree could not be read

    @property
    def verdict(self) -> str:
        if self.in_use:
            return IN_USE
        if self.why_unknown:
            return UNKNOWN
        return UNDRAINED if self.undrained else DRAINED

    @property
    def key(self) -> str:
        return self.root.name

    def store(self) -> str:
        """The checkpoint store the tier drains to (its `store` file), for the message."""
        try:
            fd = os.open(self.root / "store", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return "?"
        with os.fdopen(fd, "rb") as f:
            return os.fsdecode(f.read(4096).strip()) or "?"

    def line(self) -> str:
        """One line: the verdict, the tier's key, what and where (for logs and the epilog,
        which reads the first two words)."""
        where = f"tier {self.root} of checkpoint store {self.store()}"
        if self.in_use:
            return f"{IN_USE} {self.key}: {where} is in use by a mount (its .lock is held)"
        if self.why_unknown:
            return f"{UNKNOWN} {self.key}: {where}: {self.why_unknown}; keep it"
        if self.undrained:
            names = ", ".join(os.fsdecode(n) for n in self.undrained[:NAMES_SHOWN])
            more = " ..." if len(self.undrained) > NAMES_SHOWN else ""
            return (f"{UNDRAINED} {self.key}: {where}: {len(self.undrained)} checkpoint files "
                    f"({self.undrained_bytes} bytes) not on the store: {names}{more}")
        return f"{DRAINED} {self.key}: {where}: all {self.files} files are on the store"

    def as_dict(self) -> dict:
        return {"tier": str(self.root), "key": self.key, "store": self.store(),
                "verdict": self.verdict, "in_use": self.in_use, "files": self.files,
                "undrained": [os.fsdecode(n) for n in self.undrained],
                "undrained_bytes": self.undrained_bytes, "why_unknown": self.why_unknown}


def tiers_of(cache_dir: str, store: str | None = None) -> list[Path]:
    """The tier directories under `cache_dir` (only `store`'s, given one). Names that
    tier_path cannot make are no tiers; a link is no tier either (never followed)."""
    if store is not None:
        root = tier_path(cache_dir, store)
        return [root] if _is_real_dir(root) else []
    top = Path(cache_dir) / TIER_DIR
    if not _is_real_dir(top):
        return []
    return sorted(top / name for name in os.listdir(top)
                  if _KEY.match(name) and _is_real_dir(top / name))


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def audit_tier(root: Path) -> TierAudit:
    """Audit one tier (see the module's docstring); never raises for what it finds."""
    audit = TierAudit(root)
    audit.in_use = lock_held(root / ".lock")
    try:
        ledger = read_ledger(root / "state.db")
    except (sqlite3.Error, OSError) as err:
        audit.why_unknown = f"cannot read its ledger {root / 'state.db'} ({err})"
        return audit
    try:
        _walk(root / "tree", ledger, audit)
    except OSError as err:
        audit.why_unknown = f"cannot walk its tree {root / 'tree'} ({err.strerror or err})"
    return audit


def lock_held(path: Path) -> bool:
    """Another open file holds a flock on `path` (a live mount: dlfsd.ckpt.tier.Tier).
    Tried on a fresh descriptor, so a lock of our own process would count too. No
    file: nobody ever mounted it, not in use."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError as err:
        if err.errno == errno.ELOOP:  # a link where the lock should be: do not touch
            return True
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases our lock, if we got it
    return False


class Ledger:
    """The rows of state.db the audit needs."""

    def __init__(self, pending: set[int], evicted: set[int],
                 drained: dict[int, tuple[int, int, bytes]]) -> None:
        self.pending, self.evicted, self.drained = pending, evicted, drained

    def on_store(self, st: os.stat_result, relpath: bytes) -> bool:
        """The store holds this regular file's local bytes (dlfsd.ckpt.drain.scan's rule)."""
        if st.st_ino in self.pending:
            return False
        if st.st_ino in self.evicted:
            return st.st_ino in self.drained
        return self.drained.get(st.st_ino) == (st.st_size, st.st_mtime_ns, relpath)


def read_ledger(db_path: Path) -> Ledger:
    """pending, evicted and drained of a tier's state.db, opened read-only (a URI with
    mode=ro: never created, never written). A missing file raises (sqlite3 cannot open
    it), as does one that is no database or lacks a table."""
    if not os.path.isfile(db_path) or os.path.islink(db_path):
        raise OSError(errno.ENOENT, "no such file")
    uri = f"file:{urllib.parse.quote(os.fsencode(db_path))}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=10)
    try:
        pending = {row[0] for row in conn.execute("SELECT ino FROM pending")}
        evicted = {row[0] for row in conn.execute("SELECT ino FROM evicted")}
        drained = {row[0]: (row[1], row[2], bytes(row[3])) for row in
                   conn.execute("SELECT ino, size, mtime_ns, relpath FROM drained")}
    finally:
        conn.close()
    return Ledger(pending, evicted, drained)


def _walk(tree: Path, ledger: Ledger, audit: TierAudit) -> None:
    """Every regular file of `tree` against the ledger, by descriptors, links not
    followed (a link is never a file of ours: the daemon mirrors it, it holds no bytes).
    A directory that cannot be read makes the audit unknown, never "drained"."""
    top = os.fsencode(tree)
    if not stat.S_ISDIR(os.lstat(top).st_mode):
        raise OSError(errno.ENOTDIR, "not a directory")

    def fail(err: OSError) -> None:
        raise err

    for dirpath, dirnames, filenames, dirfd in os.fwalk(top, onerror=fail,
                                                        follow_symlinks=False):
        dirnames[:] = [d for d in dirnames if not is_adopt_temporary(d)]
        rel_dir = dirpath[len(top) + 1:]
        for name in filenames:
            if is_adopt_temporary(name):
                continue  # a placeholder of a store entry being made: no bytes of ours
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we looked
            if not stat.S_ISREG(st.st_mode):
                continue
            audit.files += 1
            relpath = os.path.join(rel_dir, name) if rel_dir else name
            if not ledger.on_store(st, relpath):
                audit.undrained.append(relpath)
                audit.undrained_bytes += st.st_size


def audit_cache(cache_dir: str, store: str | None = None) -> list[TierAudit]:
    """Audit every tier of `cache_dir` (or only `store`'s)."""
    return [audit_tier(root) for root in tiers_of(cache_dir, store)]


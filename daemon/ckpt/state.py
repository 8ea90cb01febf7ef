"""CkptState: what every daemon process must agree on about the checkpoint tier, in one
SQLite database next to the local tree (WAL; one connection per process and thread).

Why a database and not shared memory: the tree's node ids are its backing inode
numbers (dlfsd.ckpt.tree), and a request for one may reach any worker process, so
each must find the entry's path from its inode; entries come and go, names are up
to 255 bytes, and the drain state must outlive a crash of the daemon (resume on the
next mount). Checkpoints have few files, each written in large requests: the
database is asked once per lookup or per file and second of writing, never per
WRITE.

Tables:
  nodes(ino, parent, name)      where each local entry is (the root: parent 0)
  pending(ino, since_ns, touched_ns, closed, forced, tries, retry_ns, error)
                                 files whose local bytes are not on the store yet
  evicted(ino)                   drained files whose local copy was evicted (--ckpt-limit):
                                 a sparse file of the same size, mtime and inode; reads go
                                 to the store's copy, a write first copies it back
  drained(ino, size, mtime_ns, relpath, drained_ns)
                                 what the store holds of each local entry (the ledger:
                                 a file whose size, mtime or path differs is dirty); also
                                 the directories and symlinks mirrored on the store
  seen(ino, size, mtime_ns, store_ino, ctime_ns)
                                 the store's copy as this node last saw it (its own stat:
                                 a store with coarser timestamps, or another node's newer
                                 copy renamed over it, is told apart from the ledger; the
                                 change time catches a copy rewritten in place with its
                                 size and mtime put back)

Durability: commits are synchronous=NORMAL (WAL: a crash of the node may lose the last
ones, never corrupt). The rows that make a local hole stand for the store's bytes (an
eviction, an adopted placeholder) are written synchronous=FULL before the hole is made
or named: a lost `evicted` row would make the drain copy the hole over the store's
copy.

A placeholder of a store entry (dlfsd.ckpt.tree: an entry another node drained, or
this node's drained and evicted file) is a ledger row, an `evicted` row (files) and a
`seen` row: the same state an eviction leaves, so reads go to the store's copy and a
write copies it back first.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from typing import NamedTuple

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes(ino INTEGER PRIMARY KEY, parent INTEGER NOT NULL,
                                 name BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS pending(ino INTEGER PRIMARY KEY, since_ns INTEGER NOT NULL,
                                   touched_ns INTEGER NOT NULL, closed INTEGER DEFAULT 0,
                                   forced INTEGER DEFAULT 0, tries INTEGER DEFAULT 0,
                                   retry_ns INTEGER DEFAULT 0, error TEXT);
CREATE TABLE IF NOT EXISTS evicted(ino INTEGER PRIMARY KEY);
CREATE TABLE IF NOT EXISTS drained(ino INTEGER PRIMARY KEY, size INTEGER NOT NULL,
                                   mtime_ns INTEGER NOT NULL, relpath BLOB NOT NULL,
                                   drained_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS seen(ino INTEGER PRIMARY KEY, size INTEGER NOT NULL,
                                mtime_ns INTEGER NOT NULL, store_ino INTEGER NOT NULL,
                                ctime_ns INTEGER NOT NULL DEFAULT 0);
"""
_TABLES = ("nodes", "pending", "drained", "evicted", "seen")
_TRACKING = ("SELECT d.ino, d.size, d.mtime_ns, d.relpath, e.ino IS NOT NULL, "
             "p.ino IS NOT NULL, s.size, s.mtime_ns, s.store_ino, s.ctime_ns FROM drained d "
             "LEFT JOIN evicted e ON e.ino=d.ino LEFT JOIN pending p ON p.ino=d.ino "
             "LEFT JOIN seen s ON s.ino=d.ino WHERE d.ino")
_MANY = 500  # inodes per query (SQLite bounds the number of parameters)


class Tracking(NamedTuple):
    """What the state says of a local entry the store holds a copy of (the ledger)."""

    size: int
    mtime_ns: int
    relpath: bytes
    evicted: bool
    pending: bool
    seen: Identity | None  # the store copy as this node last saw it


#: A store copy's identity: (size, mtime_ns, st_ino, ctime_ns).
Identity = tuple[int, int, int, int]


def identity(st: os.stat_result) -> Identity:
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def same_identity(st: os.stat_result, seen: Identity) -> bool:
    """`st` is the copy seen as `seen` (a row from before change times were kept,
    ctime 0, compares the rest)."""
    if seen[3] == 0:
        return (st.st_size, st.st_mtime_ns, st.st_ino) == seen[:3]
    return identity(st) == seen


def same_file(st: os.stat_result, seen: Identity) -> bool:
    """`st` is the same store file as `seen`, its change time aside (what a reader or
    the union asks: is this still the version the local copy was made of)."""
    return (st.st_size, st.st_mtime_ns, st.st_ino) == seen[:3]


def _tracking(row) -> Tracking:
    return Tracking(row[1], row[2], bytes(row[3]), bool(row[4]), bool(row[5]),
                    None if row[6] is None else (row[6], row[7], row[8], row[9]))

BUSY_TIMEOUT_MS = 30_000


class _Durable:
    """`with`: the connection's own transaction context, then synchronous back to NORMAL."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        return self.db.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            self.db.__exit__(*exc)
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")


class CkptState:
    """The tier's database; `db()` is this process's and thread's connection."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        db = self.db()
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        columns = [row[1] for row in db.execute("PRAGMA table_info(seen)")]
        if "ctime_ns" not in columns:  # a tier from before change times were kept
            db.execute("ALTER TABLE seen ADD COLUMN ctime_ns INTEGER NOT NULL DEFAULT 0")

    def db(self) -> sqlite3.Connection:
        """A connection made by this process and thread (a forked child makes its own:
        SQLite connections must not cross a fork)."""
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000,
                                   isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA synchronous=NORMAL")  # see `durable`
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            local.conn, local.pid = conn, os.getpid()
        return local.conn

    # -- nodes -----------------------------------------------------------------------
    def reset_nodes(self, root_ino: int) -> None:
        db = self.db()
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM nodes")
            db.execute("INSERT INTO nodes VALUES (?, 0, x'')", (root_ino,))

    def remember(self, ino: int, parent: int, name: bytes) -> None:
        self.db().execute("INSERT OR REPLACE INTO nodes VALUES (?, ?, ?)", (ino, parent, name))

    def remember_many(self, rows: list[tuple[int, int, bytes]]) -> None:
        if rows:
            db = self.db()
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.executemany("INSERT OR REPLACE INTO nodes VALUES (?, ?, ?)", rows)

    def where(self, ino: int) -> tuple[int, bytes] | None:
        """(parent ino, name) of a known entry."""
        row = self.db().execute("SELECT parent, name FROM nodes WHERE ino=?", (ino,)).fetchone()
        return (row[0], bytes(row[1])) if row else None

    def forget(self, ino: int) -> None:
        db = self.db()
        with db:
            db.execute("BEGIN IMMEDIATE")
            for table in _TABLES:
                db.execute(f"DELETE FROM {table} WHERE ino=?", (ino,))

    def keep_only(self, inos: set[int]) -> None:
        """Drop the state of every inode not in `inos` (those in the tree, at open)."""
        db = self.db()
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("CREATE TEMP TABLE IF NOT EXISTS present(ino INTEGER PRIMARY KEY)")
            db.execute("DELETE FROM present")
            db.executemany("INSERT OR IGNORE INTO present VALUES (?)", [(i,) for i in inos])
            for table in _TABLES[1:]:  # nodes: reset_nodes
                db.execute(f"DELETE FROM {table} WHERE ino NOT IN (SELECT ino FROM present)")
            db.execute("DELETE FROM present")

    # -- copies of the store's entries ---------------------------------------------------
    def tracking(self, ino: int) -> Tracking | None:
        """Ledger, eviction, pending and seen state of `ino` (None: not on the store)."""
        row = self.db().execute(_TRACKING + "=?", (ino,)).fetchone()
        return None if row is None else _tracking(row)

    def tracking_many(self, inos: list[int]) -> dict[int, Tracking]:
        found: dict[int, Tracking] = {}
        db = self.db()
        for i in range(0, len(inos), _MANY):
            part = inos[i:i + _MANY]
            query = _TRACKING + f" IN ({','.join('?' * len(part))})"
            found.update((row[0], _tracking(row)) for row in db.execute(query, part))
        return found

    def adopt(self, ino: int, parent: int, name: bytes, size: int, mtime_ns: int,
              relpath: bytes, evicted: bool, seen: Identity | None) -> None:
        """`ino` (at `name` in directory `parent`) is a copy of the store's entry at
        `relpath`: an adopted placeholder (`evicted`: its bytes are read from the
        store), or a directory or symlink this node mirrored there. Any state an
        earlier inode of that number left is dropped first. Durable on return."""
        db = self.db()
        with self.durable(db):
            db.execute("BEGIN IMMEDIATE")
            for table in _TABLES:
                db.execute(f"DELETE FROM {table} WHERE ino=?", (ino,))
            db.execute("INSERT INTO nodes VALUES (?, ?, ?)", (ino, parent, name))
            db.execute("INSERT INTO drained VALUES (?, ?, ?, ?, ?)",
                       (ino, size, mtime_ns, relpath, time.time_ns()))
            if evicted:
                db.execute("INSERT INTO evicted VALUES (?)", (ino,))
            if seen is not None:
                db.execute("INSERT INTO seen VALUES (?, ?, ?, ?, ?)", (ino, *seen))

    @staticmethod
    def durable(db: sqlite3.Connection):
        """A transaction that is on disk when it commits (synchronous=FULL for it)."""
        db.execute("PRAGMA synchronous=FULL")
        return _Durable(db)

    def reseen(self, ino: int, seen: Identity) -> None:
        """This node changed the store's copy of `ino` itself (a rename moves its change
        time): what it sees now is still its own copy."""
        self.db().execute("UPDATE seen SET size=?, mtime_ns=?, store_ino=?, ctime_ns=? "
                          "WHERE ino=?", (*seen, ino))

    # -- evicted ---------------------------------------------------------------------
    def mark_evicted(self, ino: int) -> None:
        """Durable on return: the local copy is made a hole right after."""
        db = self.db()
        with self.durable(db):
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT OR IGNORE INTO evicted VALUES (?)", (ino,))

    def is_evicted(self, ino: int) -> bool:
        return self.db().execute("SELECT 1 FROM evicted WHERE ino=?", (ino,)).fetchone() \
            is not None

    def unevict(self, ino: int) -> None:
        self.db().execute("DELETE FROM evicted WHERE ino=?", (ino,))

    def evicted(self) -> set[int]:
        return {row[0] for row in self.db().execute("SELECT ino FROM evicted")}

    def is_pending(self, ino: int) -> bool:
        return self.db().execute("SELECT 1 FROM pending WHERE ino=?", (ino,)).fetchone() \
            is not None

    # -- pending -----------------------------------------------------------------------
    def touch(self, ino: int, now_ns: int | None = None) -> None:
        """`ino` was written: it must be drained (again) once closed or idle."""
        now = now_ns or time.time_ns()
        self.db().execute(
            "INSERT INTO pending(ino, since_ns, touched_ns) VALUES (?, ?, ?) ON CONFLICT(ino) "
            "DO UPDATE SET touched_ns=excluded.touched_ns, closed=0", (ino, now, now))

    def ensure_pending(self, rows: list[tuple[int, int]]) -> None:
        """(ino, mtime_ns) of files a scan found undrained: pending unless already."""
        if rows:
            db = self.db()
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.executemany("INSERT OR IGNORE INTO pending(ino, since_ns, touched_ns) "
                               "VALUES (?, ?, ?)", [(i, t, t) for i, t in rows])

    def closed(self, ino: int) -> None:
        """The last open of a written file was closed: drain it now."""
        self.db().execute("UPDATE pending SET closed=1 WHERE ino=?", (ino,))

    def closed_after_writing(self, ino: int, now_ns: int | None = None) -> None:
        """The last open of `ino` was closed, and one of its opens may have written it:
        drain it now (if unchanged since its last drain, the drain finds that and copies
        nothing). Inserted if missing: writes through passthrough never touch the row,
        and a drain while the file was idle-but-open removed it. Touched too, so that a
        drain publishing an older copy right now does not take the row with it."""
        now = now_ns or time.time_ns()
        self.db().execute(
            "INSERT INTO pending(ino, since_ns, touched_ns, closed) VALUES (?, ?, ?, 1) "
            "ON CONFLICT(ino) DO UPDATE SET touched_ns=excluded.touched_ns, closed=1",
            (ino, now, now))

    def force(self, inos: list[int], now_ns: int) -> None:
        """`dlfs flush`: drain these now, closed or not (inserted if missing)."""
        db = self.db()
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO pending(ino, since_ns, touched_ns, forced) VALUES (?, ?, ?, 1) "
                "ON CONFLICT(ino) DO UPDATE SET forced=1, retry_ns=0",
                [(ino, now_ns, now_ns) for ino in inos])

    def due(self, idle_ns: int, now_ns: int, limit: int) -> list[tuple[int, int]]:
        """(ino, touched_ns) of pending files to drain now, oldest first: closed, forced,
        or not written for `idle_ns`, and not waiting out a back-off."""
        return self.db().execute(
            "SELECT ino, touched_ns FROM pending WHERE retry_ns <= ? AND (closed OR forced "
            "OR touched_ns <= ?) ORDER BY since_ns LIMIT ?",
            (now_ns, now_ns - idle_ns, limit)).fetchall()

    def done(self, ino: int, touched_ns: int, size: int, mtime_ns: int, relpath: bytes,
             seen: Identity | None = None) -> None:
        """`ino` as it was when touched last at `touched_ns` is on the store at `relpath`
        (`seen`: the store copy's identity as its file system keeps it)."""
        db = self.db()
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM pending WHERE ino=? AND touched_ns=?", (ino, touched_ns))
            db.execute("UPDATE pending SET tries=0, error=NULL WHERE ino=?", (ino,))
            db.execute("INSERT OR REPLACE INTO drained VALUES (?, ?, ?, ?, ?)",
                       (ino, size, mtime_ns, relpath, time.time_ns()))
            if seen is None:
                db.execute("DELETE FROM seen WHERE ino=?", (ino,))
            else:
                db.execute("INSERT OR REPLACE INTO seen VALUES (?, ?, ?, ?, ?)", (ino, *seen))

    def failed(self, ino: int, error: str, retry_ns: int) -> None:
        """A drain of `ino` failed: try again at `retry_ns`."""
        self.db().execute("UPDATE pending SET tries=tries+1, retry_ns=?, error=? WHERE ino=?",
                          (retry_ns, error, ino))

    def closed_or_forced(self, ino: int) -> bool:
        """`ino`'s pending row says it was closed or a flush wants it now."""
        row = self.db().execute("SELECT closed OR forced FROM pending WHERE ino=?",
                              (ino,)).fetchone()
        return bool(row and row[0])

    def tries(self, ino: int) -> int:
        row = self.db().execute("SELECT tries FROM pending WHERE ino=?", (ino,)).fetchone()
        return row[0] if row else 0

    def postpone(self, ino: int, retry_ns: int) -> None:
        """Not a failure: the file changed while it was copied; copy it again later."""
        self.db().execute("UPDATE pending SET retry_ns=? WHERE ino=?", (retry_ns, ino))

    def settled(self, ino: int, touched_ns: int) -> None:
        """`ino`, as last touched at `touched_ns`, needs no drain (its pending row goes,
        unless it was written again since)."""
        self.db().execute("DELETE FROM pending WHERE ino=? AND touched_ns=?", (ino, touched_ns))

    def drop_pending(self, ino: int) -> None:
        self.db().execute("DELETE FROM pending WHERE ino=?", (ino,))

    def pending_rows(self) -> list[tuple[int, int, int, str | None]]:
        """(ino, since_ns, tries, error) of every pending file."""
        return self.db().execute(
            "SELECT ino, since_ns, tries, error FROM pending ORDER BY since_ns").fetchall()

    # -- the ledger ----------------------------------------------------------------------
    def ledger(self) -> dict[int, tuple[int, int, bytes]]:
        """ino -> (size, mtime_ns, relpath) of what the store holds."""
        return {ino: (size, mtime, bytes(rel)) for ino, size, mtime, rel in
                self.db().execute("SELECT ino, size, mtime_ns, relpath FROM drained")}

    def drained_as(self, ino: int) -> tuple[int, int, bytes] | None:
        """(size, mtime_ns, relpath) of the store's copy of `ino`, as drained; or None."""
        row = self.db().execute("SELECT size, mtime_ns, relpath FROM drained WHERE ino=?",
                                (ino,)).fetchone()
        return (row[0], row[1], bytes(row[2])) if row else None

    def drained_at(self, ino: int) -> bytes | None:
        row = self.db().execute("SELECT relpath FROM drained WHERE ino=?", (ino,)).fetchone()
        return bytes(row[0]) if row else None

    def moved(self, old: bytes, new: bytes) -> None:
        """The store's copies under `old` (a file or a directory) are now under `new`."""
        db = self.db()
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("UPDATE drained SET relpath=? WHERE relpath=?", (new, old))
            prefix = old + b"/"
            db.execute("UPDATE drained SET relpath=? || substr(relpath, ?) "
                       "WHERE substr(relpath, 1, ?)=?",
                       (new + b"/", len(prefix) + 1, len(prefix), prefix))

    def drop_drained(self, ino: int) -> None:
        self.db().execute("DELETE FROM drained WHERE ino=?", (ino,))

    def drained_rows(self) -> list[tuple[int, int, int]]:
        """(ino, size, drained_ns) of the ledger, oldest drain first (eviction order)."""
        return self.db().execute(
            "SELECT ino, size, drained_ns FROM drained ORDER BY drained_ns").fetchall()

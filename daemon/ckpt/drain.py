"""Drainer: copies closed checkpoint files from the node-local tier to the checkpoint
store in the background (threads of the daemon's main process), never half a file.

Each file is copied to a hidden temporary name beside its target
(`.NAME.dlfs-drain-HOST-RANDOM`), hashed while read (xxh3-64), flushed to disk,
read back and compared, and only then renamed to its name: a reader of the store
sees a checkpoint file complete or not at all. If the local file changed while it
was copied (its size or mtime moved), the copy is thrown away and made again.

What is pending lives in dlfsd.ckpt.state; the ledger `drained` says what the store
holds of each local file, so a scan of the tree (at start: resume after a crash or a
reboot; then every SCAN_EVERY seconds, and on `dlfs flush`) finds every file whose
local bytes the store does not have yet, whoever missed telling us.

Failures (a read-only or full store, a network file system gone): the local copy
stays, the file is tried again after a back-off that doubles from 0.5 s to 30 s,
and the trouble is logged once when it starts and once when it ends, and shown in
`dlfs status` until then.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import socket
import stat
import threading
import time

import xxhash

from dlfsd.base.nodeids import CKPT_BIT
from dlfsd.ckpt import sums
from dlfsd.ckpt.beneath import Beneath
from dlfsd.ckpt.state import identity, same_file, same_identity
from dlfsd.ckpt.tier import TMP_MARK, Tier, is_adopt_temporary, tmp_name
from dlfsd.ckpt.tree import CkptTree

log = logging.getLogger("dlfsd")

BLOCK = 4 << 20
#: Writeback of the copy is started (not waited for) every this many bytes: with the
#: default dirty ratios a 2 GiB copy would otherwise stay in the page cache and be
#: written at the final fsync, after the paced copy instead of during it. Not an
#: fdatasync each time: on ext4 each one also waits for a journal commit (measured,
#: 2 GiB paced at 200 MiB/s: 92-148 MiB/s with fdatasync every 64 MiB).
WRITEBACK_EVERY = 64 << 20
SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing back a range of `fd` without waiting (sync_file_range; where the
    C library lacks it, the final fsync does all the work)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, max(offset, 0), length, SYNC_FILE_RANGE_WRITE)
SCAN_EVERY = 5.0  # seconds between scans of the tree for files nobody queued
IDLE = 2.0  # seconds without a write after which an open file is drained anyway
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 30.0
RATE_WINDOW = 10.0  # seconds the drain rate is averaged over
LIMIT_EVERY = 1.0  # seconds between checks of --ckpt-limit
LOW_WATER = 0.9  # eviction under --ckpt-limit goes down to this share of it
SAMPLE_CONFLICTS = 10  # conflict names status shows


class DrainStats:
    """What the drain did (main process only; shown through DrainReport)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files = self.bytes = self.failures = self.discarded = 0
        self.recent: list[tuple[float, int]] = []  # (monotonic, bytes) of recent drains
        self.error: str | None = None
        self.failing_since: float | None = None
        self.conflict_count = 0  # files kept under a conflict name (Drainer._conflict)
        self.conflicts: list[str] = []  # the last SAMPLE_CONFLICTS of their names

    def drained(self, nbytes: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.files += 1
            self.bytes += nbytes
            self.recent.append((now, nbytes))

    def rate(self) -> float:
        """Bytes/s over the last RATE_WINDOW seconds."""
        now = time.monotonic()
        with self.lock:
            self.recent = [(t, n) for t, n in self.recent if now - t <= RATE_WINDOW]
            return sum(n for _, n in self.recent) / RATE_WINDOW


class SharedPace:
    """--drain-bandwidth for all copying threads together: each block books the next
    n / rate seconds of one shared clock and waits until its booking ends (one file
    alone gets the whole rate; several share it)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._booked = 0.0

    def wait(self, nbytes: int, started: float) -> None:
        """After a block of `nbytes` whose copy began at `started` (monotonic)."""
        if self.rate <= 0:
            return
        with self._lock:
            self._booked = max(self._booked, started) + nbytes / self.rate
            until = self._booked
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class Drainer:
    """The drain: `jobs` copying threads and a scanning thread, started by `start()`."""

    def __init__(self, tier: Tier, jobs: int = 2, bandwidth: int = 0,
                 idle: float = IDLE, limit: int = 0, keep: int = 1,
                 open_files=None, passthrough: bool = False) -> None:
        """`limit`: bytes the local copies may take (0: none; nothing is evicted);
        `keep`: the newest top-level entries of the tree never evicted (the store's
        copies are made as the job's user, tier.creds, so they are the user's);
        `open_files`: dlfsd.ckpt.openfiles.OpenFiles, the files open on the mount now
        (never evicted; those open through passthrough are timed by mtime, see
        `_written_lately`); `passthrough`: the kernel granted FUSE passthrough on the
        checkpoint connection (reported with the open files)."""
        self.tier = tier
        self.open_files = open_files
        self.passthrough = passthrough
        self.limit, self.keep = limit, keep
        self.local_bytes = 0
        self.evicted_files = 0
        self.state = tier.state
        self.jobs = max(1, jobs)
        self.pace = SharedPace(bandwidth)  # bytes/s of all jobs together (0: unpaced)
        self.idle_ns = int(idle * 1e9)
        self.stats = DrainStats()
        self._busy: set[int] = set()
        self._busy_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._trees: dict[int, CkptTree] = {}  # per thread: its path cache
        self._sums_warned = False  # a failure to write sums is logged once at WARNING

    def _tree(self) -> CkptTree:
        key = threading.get_ident()
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = CkptTree(self.tier)
        return tree

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Clean up our own leftovers on the store, find what is undrained, then drain."""
        self._threads = [threading.Thread(target=self._scanning, name="ckpt-scan",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._draining, name=f"ckpt-drain-{i}",
                                           daemon=True) for i in range(self.jobs)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def wake(self) -> None:
        self._wake.set()

    def finish(self, timeout: float) -> int:
        """The connection is gone (aborted, its workers dead): nobody can write ckpt/ or
        run `dlfs flush` any more, and the epilog will find no mount to flush. Drain
        every file the store lacks now, closed or not, for at most `timeout` seconds;
        what is left stays in the tier (the epilog keeps an undrained tier, the next
        mount drains it). Returns the number of files left."""
        left = scan(self.tier, force=True)
        if not left:
            return 0
        log.warning("checkpoint connection lost: draining %d files to %s before the daemon "
                    "exits (at most %g s)", len(left), self.tier.store, timeout)
        self._wake.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = len(self.state.pending_rows())
            if not pending:
                log.info("checkpoint connection lost: every file is on %s", self.tier.store)
                return 0
            time.sleep(0.2)
        pending = len(self.state.pending_rows())
        log.error("checkpoint connection lost: %d files not drained to %s after %g s; they "
                  "stay in %s and the next mount of this store on this node drains them",
                  pending, self.tier.store, timeout, self.tier.tree)
        return pending

    # -- scanning --------------------------------------------------------------------------
    def _scanning(self) -> None:
        background_priority()
        try:
            self._remove_stale_temporaries()
            resumed = scan(self.tier)
            if resumed:
                log.info("checkpoint tier %s: %d files not on the store %s yet; draining "
                         "them", self.tier.root, len(resumed), self.tier.store)
            last_scan = time.monotonic()
            while not self._stop.wait(LIMIT_EVERY if self.limit else SCAN_EVERY):
                if self.limit:
                    self._enforce_limit()
                if time.monotonic() - last_scan >= SCAN_EVERY:
                    last_scan = time.monotonic()
                    if scan(self.tier):
                        self._wake.set()
        except Exception:
            log.exception("checkpoint scan failed")

    # -- the limit -------------------------------------------------------------------------
    def _enforce_limit(self) -> None:
        """Evict drained files, oldest drain first, never from the `keep` newest
        checkpoints, until the local copies take LOW_WATER of the limit; say "full"
        (writes wait, then ENOSPC) while they take the whole limit."""
        files = local_files(self.tier)
        used = sum(blocks for _, _, _, blocks in files)
        if used > self.limit * LOW_WATER:
            used -= self._evict(files, used - int(self.limit * LOW_WATER))
        self.local_bytes = used
        self.tier.set_full(used >= self.limit)

    def _evict(self, files: list, want: int) -> int:
        ledger = self.state.ledger()
        evicted = self.state.evicted()
        kept = newest_entries(self.tier, self.keep)
        order = {ino: n for n, (ino, _, _) in enumerate(self.state.drained_rows())}
        candidates = sorted(
            (order[st.st_ino], path, st, blocks) for path, rel, st, blocks in files
            if st.st_ino in order and st.st_ino not in evicted and blocks
            and ledger.get(st.st_ino) == (st.st_size, st.st_mtime_ns, rel)
            and rel.split(b"/", 1)[0] not in kept)
        freed = 0
        for _, path, st, blocks in candidates:
            if freed >= want:
                break
            if self._evict_one(path, st):
                freed += blocks
                self.evicted_files += 1
        return freed

    def _evict_one(self, path: bytes, st: os.stat_result) -> bool:
        """Make the local copy of drained file `path` a hole, only once its store copy is
        known sound: the copy this node published (same identity), whose bytes match
        their sums (or, without sums, the local bytes). The check reads the store's
        copy, outside the lock; under it, nothing may have changed since."""
        if not self._store_copy_sound(path, st):
            return False
        with self.tier.mutating(), self._open_files_locked():
            if _changed(self.tier.local, path, st) or self.state.is_pending(st.st_ino):
                return False
            if self.open_files is not None and self.open_files.is_open(st.st_ino):
                return False  # a reader (or the kernel, with passthrough) uses this copy
            row = self.state.tracking(st.st_ino)
            stored = self.tier.store_fs.lstat_or_none(path)
            if row is None or row.seen is None or stored is None \
                    or not same_identity(stored, row.seen):
                return False
            self.state.mark_evicted(st.st_ino)  # durable: opens now read the store's copy
            self.tier.bump_epoch()  # every process drops its descriptor of the local copy
            fd = self.tier.local.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, st.st_size)  # a hole of the same size, inode and mtime
            finally:
                os.close(fd)
            self.tier.local.utime(path, (st.st_atime_ns, st.st_mtime_ns))
        log.debug("evicted the local copy of checkpoint %s", os.fsdecode(path))
        return True

    def _store_copy_sound(self, path: bytes, st: os.stat_result) -> bool:
        """The store holds this node's copy of `path` (the identity it recorded) and its
        bytes pass their sums (without sums: equal the local copy's, extent by extent).
        A copy removed, replaced or damaged on the store keeps the local one: it may be
        the last good copy."""
        row = self.state.tracking(st.st_ino)
        if row is None or row.relpath != path or row.seen is None:
            return False
        store, local = self.tier.store_fs, self.tier.local
        try:
            fd = store.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            copy = os.fstat(fd)
            if not same_identity(copy, row.seen) or copy.st_size != st.st_size:
                return False
            check = sums.load(store, copy, os.fsdecode(path))
            mine = None if check is not None else local.open(path, os.O_RDONLY)
            try:
                return _extents_match(fd, check, mine)
            finally:
                if mine is not None:
                    os.close(mine)
        except OSError as err:
            log.debug("checkpoint %s kept (its store copy cannot be checked: %s)",
                      os.fsdecode(path), err)
            return False
        finally:
            os.close(fd)

    def _open_files_locked(self):
        if self.open_files is None:
            return contextlib.nullcontext()
        return self.open_files.locked()

    def _remove_stale_temporaries(self) -> None:
        """A drain cut short (daemon killed) leaves its temporary file: remove ours."""
        host = tmp_name(b"x").split(TMP_MARK)[1].rsplit(b"-", 1)[0]
        store = self.tier.store_fs
        try:
            listing = store.walk()
        except OSError:
            return  # no store (yet): nothing of ours on it
        for directory, entries in listing:
            for name, st in entries:
                if TMP_MARK + host + b"-" in name and name.startswith(b".") \
                        and not stat.S_ISDIR(st.st_mode):
                    with contextlib.suppress(OSError):
                        store.unlink(os.path.join(directory, name))

    # -- draining ----------------------------------------------------------------------------
    def _draining(self) -> None:
        background_priority()
        while not self._stop.is_set():
            job = self._next()
            if job is None:
                self._wake.wait(0.2)
                self._wake.clear()
                continue
            ino, touched_ns = job
            try:
                self._drain(ino, touched_ns)
            except Exception as err:
                self._failed(ino, err)
            finally:
                with self._busy_lock:
                    self._busy.discard(ino)

    def _next(self) -> tuple[int, int] | None:
        now = time.time_ns()
        try:
            due = self.state.due(self.idle_ns, now, self.jobs * 2 + 1)
        except Exception as err:  # a locked database: try again soon
            log.debug("checkpoint drain: %s", err)
            return None
        with self._busy_lock:
            for ino, touched_ns in due:
                if ino not in self._busy:
                    self._busy.add(ino)
                    return ino, touched_ns
        return None

    def _drain(self, ino: int, touched_ns: int) -> None:
        tree = self._tree()
        local, store = self.tier.local, self.tier.store_fs
        try:
            path = tree.path_of(CKPT_BIT | ino)
        except Exception:
            self.state.drop_pending(ino)  # removed meanwhile
            return
        st = local.lstat(path)
        if not stat.S_ISREG(st.st_mode) or self.state.is_evicted(ino):
            self.state.drop_pending(ino)  # an evicted file's local copy is a hole
            return
        if self._written_lately(ino, st):
            return
        if self._on_store_already(ino, path, st):
            self.state.settled(ino, touched_ns)
            return
        target_dir = os.path.dirname(path)
        self.tier.makedirs_on_store(target_dir)
        tmp = os.path.join(target_dir, tmp_name(os.path.basename(path)))
        copy, published = None, False
        try:
            digest, extents = self._copy(path, tmp)
            if _changed(local, path, st):
                self.stats.discarded += 1  # written again meanwhile: once it is idle
                self.state.postpone(ino, time.time_ns() + self.idle_ns)
                return
            if _hash_file(store, tmp) != digest:
                raise OSError(errno.EIO, f"the store's copy of {os.fsdecode(path)} reads "
                                         "back different bytes")
            copy = self._finish_copy(tmp, st, extents)  # outside the lock: store round trips
            with self.tier.mutating():
                if not self._publish(tree, ino, touched_ns, st, tmp, copy):
                    return
            published = True
        finally:
            if not published:
                with contextlib.suppress(OSError):
                    store.unlink(tmp)
                sums.remove(store, copy)  # (None: none written)
                if target_dir and not local.isdir(os.path.dirname(path)):
                    # Its directory was removed meanwhile (`rm -r`, whose rmdir left the
                    # store's directory to us: it held only this temporary then).
                    with contextlib.suppress(OSError):
                        store.rmdir(target_dir)
        self.stats.drained(st.st_size)
        if self.stats.failing_since is not None:
            log.info("checkpoint drain to %s works again", self.tier.store)
            self.stats.failing_since = None
            self.stats.error = None

    def _on_store_already(self, ino: int, path: bytes, st: os.stat_result) -> bool:
        """The store holds this very version (a file opened for writing and closed
        unchanged: h5py's "r+", a passthrough open whose writes we cannot see): no copy.
        The store's entry must be the copy this node published (its identity)."""
        row = self.state.tracking(ino)
        if row is None or (row.size, row.mtime_ns, row.relpath) != (
                st.st_size, st.st_mtime_ns, path):
            return False
        stored = self.tier.store_fs.lstat_or_none(path)
        if stored is None:
            return False  # removed from the store by hand: copy it again
        if row.seen is not None:
            return same_identity(stored, row.seen)
        return (stored.st_size, stored.st_mtime_ns) == (st.st_size, st.st_mtime_ns)

    def _written_lately(self, ino: int, st: os.stat_result) -> bool:
        """A file open through passthrough, neither closed nor flushed, written less than
        `idle` ago: the daemon sees no WRITE of it (its pending row is as old as its
        open), so the local copy's mtime says whether it is idle; if not, try later."""
        if self.open_files is None or not self.open_files.passthrough(ino):
            return False
        until = st.st_mtime_ns + self.idle_ns
        if until <= time.time_ns() or self.state.closed_or_forced(ino):
            return False
        self.state.postpone(ino, until)
        return True

    def _finish_copy(self, tmp: bytes, st: os.stat_result, extents: list[int]
                     ) -> os.stat_result:
        """Give the checked copy the local file's mode bits and times, and write its
        sums (`extents`, dlfsd.ckpt.sums) before it is published: a reader never finds
        it without them. Returns its stat as the store keeps it (timestamps may be
        coarser), which names its sums."""
        store = self.tier.store_fs
        store.chmod(tmp, stat.S_IMODE(st.st_mode))  # a 0600 checkpoint stays 0600
        store.utime(tmp, (st.st_atime_ns, st.st_mtime_ns))
        copy = store.lstat(tmp)
        self._write_sums(copy, extents)
        return copy

    def _publish(self, tree: CkptTree, ino: int, touched_ns: int, st: os.stat_result,
                 tmp: bytes, copy: os.stat_result) -> bool:
        """Rename the checked copy into place at the path the file has now, if the
        store's entry there is still the one this node last saw (or none): never over
        another node's newer copy (a requeued job's stale local copy would roll the
        store back). Otherwise the local file is kept under a conflict name, drained
        under it next. The sums of the copy it replaces go."""
        try:
            path = tree.path_of(CKPT_BIT | ino)
        except Exception:
            self.state.drop_pending(ino)
            return False
        if _changed(self.tier.local, path, st):
            self.state.postpone(ino, time.time_ns())
            return False
        store = self.tier.store_fs
        self.tier.makedirs_on_store(os.path.dirname(path))
        replaced = store.lstat_or_none(path)
        if replaced is not None and not self._replaceable(ino, path, replaced):
            self._conflict(tree, ino, path)
            return False
        store.rename(tmp, path)
        sums.remove(store, replaced)
        with contextlib.suppress(OSError):
            store.fsync_dir(os.path.dirname(path))
        published = store.lstat(path)  # the rename may have moved its change time
        self.state.done(ino, touched_ns, st.st_size, st.st_mtime_ns, path,
                        identity(published if published.st_ino == copy.st_ino else copy))
        return True

    def _replaceable(self, ino: int, path: bytes, replaced: os.stat_result) -> bool:
        """The store's entry at `path` is the file this node last saw there for `ino`
        (another node's drain renames a new inode into place; a copy changed in place,
        its change time moved, is still that file: a newer version may replace it)."""
        if not stat.S_ISREG(replaced.st_mode):
            return False
        row = self.state.tracking(ino)
        if row is None or row.relpath != path:
            return False
        if row.seen is not None:
            return same_file(replaced, row.seen)
        return (replaced.st_size, replaced.st_mtime_ns) == (row.size, row.mtime_ns)

    def _conflict(self, tree: CkptTree, ino: int, path: bytes) -> None:
        """Keep this node's version of `path` beside the store's newer one: rename it to
        NAME.dlfs-conflict-HOST-TIME here (drained under that name next), say so."""
        name = os.path.basename(path)
        keep = os.path.join(os.path.dirname(path), conflict_name(name))
        parent = self.tier.local.lstat(os.path.dirname(path)).st_ino
        if self.tier.local.exists(keep):
            raise OSError(errno.EEXIST, "conflict name taken", keep)
        self.tier.local.rename(path, keep)
        self.state.remember(ino, parent, os.path.basename(keep))
        tree.forget_path(ino)
        self.state.postpone(ino, 0)
        self.stats.conflicts.append(os.fsdecode(keep))
        del self.stats.conflicts[:-SAMPLE_CONFLICTS]
        self.stats.conflict_count += 1
        log.warning("checkpoint %s: the store's copy changed since this node last saw it "
                    "(another node wrote it); this node's version is kept as %s and drained "
                    "under that name, the store's stays", os.fsdecode(path), os.fsdecode(keep))

    def _write_sums(self, copy: os.stat_result, extents: list[int]) -> None:
        """The sums of store copy `copy`; a failure is logged (once at WARNING) and the
        copy published all the same: its reads are then unchecked, not refused."""
        try:
            sums.write(self.tier.store_fs, copy, extents)
        except (OSError, ValueError) as err:
            level = logging.DEBUG if self._sums_warned else logging.WARNING
            self._sums_warned = True
            log.log(level, "checkpoint checksums cannot be written to %s (%s); the files "
                    "drained meanwhile are read unchecked from the store",
                    self.tier.store_fs.display(sums.SUMS_DIR),
                    err.strerror if isinstance(err, OSError) else err)

    def _copy(self, source: bytes, tmp: bytes) -> tuple[int, list[int]]:
        """Copy local `source` to `tmp` on the store (paced to --drain-bandwidth);
        returns the xxh3-64 of the bytes read, and that of each of their extents (the
        sums readers check)."""
        hasher = xxhash.xxh3_64()
        extents = sums.ExtentHasher()
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        src = self.tier.local.open(source, os.O_RDONLY)
        try:
            dst = self.tier.store_fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                offset = 0
                while True:
                    if self._stop.is_set():
                        raise OSError(errno.EINTR, "the daemon stops")
                    started = time.monotonic()
                    n = os.readv(src, [buf])
                    if n == 0:
                        break
                    hasher.update(view[:n])
                    extents.update(view[:n])
                    done = 0
                    while done < n:
                        done += os.write(dst, view[done:n])
                    offset += n
                    if offset % WRITEBACK_EVERY < n:  # write back as we go, not at the end
                        start_writeback(dst, offset - WRITEBACK_EVERY, WRITEBACK_EVERY)
                    self.pace.wait(n, started)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return hasher.intdigest(), extents.finish()

    def _failed(self, ino: int, err: Exception) -> None:
        message = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        if isinstance(err, OSError) and err.filename:
            message = f"{message}: {os.fsdecode(err.filename)}"
        try:
            delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** self.state.tries(ino))
            self.state.failed(ino, message, time.time_ns() + int(delay * 1e9))
        except Exception:
            log.debug("checkpoint drain: cannot note a failure", exc_info=True)
        self.stats.failures += 1
        self.stats.error = message
        if self.stats.failing_since is None:
            self.stats.failing_since = time.time()
            log.warning("checkpoint drain to %s fails (%s); the local copies stay in %s and "
                        "are tried again with back-off", self.tier.store, message,
                        self.tier.tree)

    # -- what status shows ------------------------------------------------------------------
    def _open_counts(self) -> dict:
        if self.open_files is None:
            return {"open_files": None, "passthrough_open": None}
        files, passthrough = self.open_files.counts()
        return {"open_files": files, "passthrough_open": passthrough if self.passthrough
                else None}

    def report(self) -> dict:
        """Pending files and bytes, the oldest, rate, ETA, totals, trouble."""
        tree = self._tree()
        queued = queued_bytes = 0
        oldest = None
        oldest_ns = None
        for ino, since_ns, _tries, _error in self.state.pending_rows():
            try:
                path = tree.path_of(CKPT_BIT | ino)
                size = self.tier.local.lstat(path).st_size
            except Exception:
                continue
            queued += 1
            queued_bytes += size
            if oldest is None:
                oldest, oldest_ns = os.fsdecode(path), since_ns
        rate = self.stats.rate()
        return {
            "store": self.tier.store, "local": str(self.tier.tree),
            "queued_files": queued, "queued_bytes": queued_bytes,
            "drained_files": self.stats.files, "drained_bytes": self.stats.bytes,
            "drain_rate": rate,
            "eta_seconds": (queued_bytes / rate) if rate > 0 else None,
            "oldest_undrained": oldest,
            "oldest_undrained_age": (time.time_ns() - oldest_ns) / 1e9 if oldest_ns else None,
            "failures": self.stats.failures, "error": self.stats.error,
            "limit": self.limit, "local_bytes": self.local_bytes if self.limit else None,
            "evicted_files": self.evicted_files, "full": self.tier.full(),
            "failing_since": self.stats.failing_since,
            "conflicts": self.stats.conflict_count,
            "conflict_names": list(self.stats.conflicts),
            **self._open_counts(),
        }


DRAIN_NICE = 10  # added to the daemon's nice value for the drain's threads
IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the ioprio_set syscall's number
IOPRIO_WHO_PROCESS, IOPRIO_CLASS_BE, IOPRIO_LOWEST = 1, 2, 7


def background_priority() -> None:
    """Make the calling thread background work: CPU niceness +10 and the lowest
    best-effort I/O priority (both per thread on Linux). The drain copies, hashes and
    reads back gigabytes while training reads its samples through the same node: on
    a busy node it must yield to the FUSE workers and the readers, and it still gets
    whatever they leave (--drain-bandwidth caps it, this only ranks it)."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + DRAIN_NICE))
    number = IOPRIO_SET.get(os.uname().machine)
    if number is not None:
        _libc.syscall(number, IOPRIO_WHO_PROCESS, tid,
                      IOPRIO_CLASS_BE << 13 | IOPRIO_LOWEST)


def local_files(tier: Tier) -> list[tuple[bytes, bytes, os.stat_result, int]]:
    """(path, relpath, stat, bytes on disk) of every regular file of the tree (the path
    is the relative path: the tree is only reached through tier.local)."""
    found = []
    for directory, entries in tier.local.walk(skip=is_adopt_temporary):
        for name, st in entries:
            if stat.S_ISREG(st.st_mode):
                rel = os.path.join(directory, name)
                found.append((rel, rel, st, st.st_blocks * 512))
    return found


def newest_entries(tier: Tier, keep: int) -> set[bytes]:
    """Names of the `keep` newest top-level entries of the tree (the last checkpoints)."""
    if keep <= 0:
        return set()
    entries = []
    for name in tier.local.listdir(b""):
        with contextlib.suppress(OSError):
            entries.append((newest_mtime(tier, name), name))
    return {name for _, name in sorted(entries, reverse=True)[:keep]}


def newest_mtime(tier: Tier, rel: bytes) -> int:
    """The newest mtime of entry `rel` and everything under it."""
    st = tier.local.lstat(rel)
    newest = st.st_mtime_ns
    if stat.S_ISDIR(st.st_mode):
        for _, entries in tier.local.walk(rel):
            for _, child in entries:
                newest = max(newest, child.st_mtime_ns)
    return newest


def scan(tier: Tier, under: bytes | None = None, force: bool = False,
         now_ns: int | None = None) -> list[int]:
    """Record every entry of the tree (under directory `under`, relative) in the node
    table, and queue the files whose local bytes are not on the store yet (by the
    ledger). Returns their inodes. With `force` they are drained now, closed or not
    (`dlfs flush`; a file that had no pending row gets one pending since `now_ns`, the
    flush's start). Evicted files and placeholders of the store's entries have no local
    bytes to drain."""
    state = tier.state
    ledger = state.ledger()
    evicted = state.evicted()
    top = under or b""
    inos = {top: tier.local.lstat(top).st_ino}
    rows, dirty, stamps = [], [], []
    for directory, entries in tier.local.walk(top, skip=is_adopt_temporary):
        parent = inos.get(directory)
        if parent is None:
            continue
        for name, st in entries:
            rel = os.path.join(directory, name) if directory else name
            rows.append((st.st_ino, parent, name))
            if stat.S_ISDIR(st.st_mode):
                inos[rel] = st.st_ino
            elif stat.S_ISREG(st.st_mode) and st.st_ino not in evicted \
                    and ledger.get(st.st_ino) != (st.st_size, st.st_mtime_ns, rel):
                dirty.append(st.st_ino)
                stamps.append(st.st_mtime_ns)
    state.remember_many(rows)
    if force:
        state.force(dirty, now_ns or time.time_ns())
    else:
        state.ensure_pending(list(zip(dirty, stamps, strict=True)))
    return dirty


def conflict_name(name: bytes) -> bytes:
    """NAME.dlfs-conflict-HOST-YYYYmmddTHHMMSS: where a node keeps its version of a file
    whose store copy another node replaced meanwhile (shown in ckpt/, drained)."""
    host = socket.gethostname().encode(errors="replace").replace(b".", b"_")[:32]
    return name[:160] + b".dlfs-conflict-" + host + b"-" + \
        time.strftime("%Y%m%dT%H%M%S").encode()


def _extents_match(fd: int, check: sums.ExtentCheck | None, local: int | None) -> bool:
    """The bytes of `fd` pass `check`'s sums, or (without sums) equal those of `local`."""
    buf = bytearray(sums.EXTENT)
    view = memoryview(buf)
    other = memoryview(bytearray(sums.EXTENT if local is not None else 0))
    offset = index = 0
    while n := sums.read_full(fd, view, offset):
        if check is not None:
            if not check.matches(index, view[:n]):
                return False
        elif local is None:
            return False  # nothing to compare with: not shown to match
        elif sums.read_full(local, other, offset) != n or view[:n] != other[:n]:
            return False
        offset += n
        index += 1
    return True


def _changed(local: Beneath, path: bytes, st: os.stat_result) -> bool:
    try:
        now = local.lstat(path)
    except OSError:
        return True
    return (now.st_ino, now.st_size, now.st_mtime_ns) != (st.st_ino, st.st_size,
                                                          st.st_mtime_ns)


def _hash_file(store: Beneath, rel: bytes) -> int:
    hasher = xxhash.xxh3_64()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    fd = store.open(rel, os.O_RDONLY)
    try:
        while n := os.readv(fd, [buf]):
            hasher.update(view[:n])
    finally:
        os.close(fd)
    return hasher.intdigest()

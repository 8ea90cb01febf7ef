"""ChunkCache: this node's staged copies of one dataset's chunks on local NVMe.

Layout: CACHE_DIR/<dataset uuid hex>/<index>.chunk, byte-identical copies of
the store's chunk files (header included), written under a temporary name,
synced and renamed into place (the directory synced too: durable before staged).
Which chunks are staged lives in an anonymous shared mapping (one byte per
chunk: 0 = absent, else a generation number), so the stager in the main
process and the readers in forked workers agree without messages; a reader
reopens its file descriptor when the generation changed (the chunk was
evicted as corrupt and staged again). Generations count on across evictions
(a second shared byte per chunk remembers the last one): a copy staged again
after an eviction must not get the generation of the copy it replaces, or a
process still holding that old, unlinked file would take it for current, find
it bad again and evict the good copy, over and over.

A re-mount reuses what a previous mount staged: files whose header and size
are right count as staged; their bytes are checked on first read like any
other, and a chunk that fails that check is evicted and staged again. Such
adopted copies are marked (a third shared byte per chunk, cleared when the
copy is replaced or evicted), so `dlfs status` can tell cache hits from
earlier jobs apart from what this job staged.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from dlfs.errors import FormatError
from dlfs.store.format import CHUNK_HEADER_SIZE, check_chunk_header, chunk_filename
from dlfs.store.nodecache import mark_in_use, touch_last_used
from dlfs.store.store import Dataset, fsync_path

log = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"


class ChunkCache:
    """Staged chunk files of one dataset in a node-local directory."""

    def __init__(self, cache_root: Path, dataset: Dataset) -> None:
        self.dataset = dataset
        self.dir = Path(cache_root) / dataset.uuid.hex()
        self._in_use_fd = -1  # the shared `.in-use` lock (dlfs.store.nodecache)
        self.lengths = dataset.chunk_lengths
        count = dataset.chunk_count
        self._state = mmap.mmap(-1, max(1, count))  # shared with forked workers
        self._view = np.frombuffer(self._state, dtype=np.uint8)[:count]
        self._last_gen = mmap.mmap(-1, max(1, count))  # written by the stager only
        self._adopted = mmap.mmap(-1, max(1, count))  # 1: the copy came from an earlier mount
        self._adopted_view = np.frombuffer(self._adopted, dtype=np.uint8)[:count]
        self.adopted_at_mount = 0  # chunks kept at mount (ChunkPool.scan_caches)
        self._fds = [-1] * count  # per process
        self._fd_gen = bytearray(count)
        self._retired: list[int] = []  # superseded copies' fds (see open_fd)
        self._open_lock = threading.Lock()

    # -- state shared by all processes ----------------------------------------
    def is_staged(self, chunk: int) -> bool:
        return self._state[chunk] != 0

    @property
    def state_map(self) -> mmap.mmap:
        """The shared byte per chunk (0: not staged, else the copy's generation), to
        read only: ExtentSource's plan tests it on every pooled read, without a call."""
        return self._state

    def generation(self, chunk: int) -> int:
        """The current copy's generation (1-255, new at every publish), 0 if none."""
        return self._state[chunk]

    def staged_mask(self) -> np.ndarray:
        return self._view != 0

    def is_adopted(self, chunk: int) -> bool:
        """The current copy was staged by an earlier mount (an earlier job, a warm-up)."""
        return self._adopted[chunk] != 0

    def adopted_mask(self) -> np.ndarray:
        return self._adopted_view != 0

    def staged_bytes(self) -> int:
        return int(self.lengths[self.staged_mask()].sum())

    def path(self, chunk: int) -> Path:
        return self.dir / chunk_filename(chunk)

    def temp_path(self, chunk: int) -> Path:
        return self.dir / f"{TEMP_PREFIX}{chunk_filename(chunk)}.{os.getpid()}"

    def publish(self, chunk: int, temp: Path) -> None:
        """Rename a fully written, verified copy into place and mark it staged. Blocks.

        The copy's data reaches the disk before its name does, and the name before it
        counts as staged: a re-mount adopts copies by header and size alone (and
        --no-verify trusts their bytes), so after a crash a renamed but unwritten copy
        would be adopted zero-filled and served as wrong bytes.
        """
        fsync_path(temp)
        os.rename(temp, self.path(chunk))
        fsync_path(self.dir)
        gen = self._last_gen[chunk] % 255 + 1
        self._last_gen[chunk] = gen
        self._adopted[chunk] = 0
        self._state[chunk] = gen

    def evict(self, chunk: int) -> None:
        """Forget a staged copy (it failed a checksum): readers stop using it."""
        gen = self._state[chunk]
        if gen == 0:
            return
        # The file first: the stager could publish a new copy between the two steps,
        # and clearing the state first would then delete that one while it counts as
        # staged (never opened, never staged again).
        with contextlib.suppress(FileNotFoundError):
            self.path(chunk).unlink()
        self._adopted[chunk] = 0
        self._state[chunk] = 0

    # -- mount time -------------------------------------------------------------
    def scan(self) -> int:
        """Adopt copies a previous mount staged (right header and size); drop the rest.

        Returns the number of chunks adopted. Runs before the workers fork.
        """
        # Private: a staged copy is a dataset's bytes, whatever modes its store has (the
        # mount itself may be for one user only, --uid); the daemon alone reads them.
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if self._in_use_fd < 0:  # held while the mount lives: `dlfs cache prune` skips us
            self._in_use_fd = mark_in_use(self.dir, self.dataset.name, str(self.dataset.path))
        adopted = 0
        for entry in os.scandir(self.dir):
            if entry.name.startswith(TEMP_PREFIX):
                if not _writer_alive(entry.name):  # another daemon's copy in progress stays
                    _remove(entry.path)
                continue
            chunk = _chunk_index(entry.name)
            if chunk is None or chunk >= self.dataset.chunk_count:
                continue
            if self._valid_copy(Path(entry.path), chunk):
                self._state[chunk] = self._last_gen[chunk] = 1
                self._adopted[chunk] = 1
                adopted += 1
            else:
                log.warning("dropping unusable staged copy %s", entry.path)
                _remove(entry.path)
        return adopted

    def _valid_copy(self, path: Path, chunk: int) -> bool:
        try:
            with open(path, "rb") as f:
                length = check_chunk_header(f.read(CHUNK_HEADER_SIZE), path, chunk,
                                            self.dataset.uuid)
                size = os.fstat(f.fileno()).st_size
        except (OSError, FormatError):
            return False
        return length == self.lengths[chunk] and size == CHUNK_HEADER_SIZE + length

    # -- per-process file descriptors -------------------------------------------
    def fd(self, chunk: int) -> int:
        """This process's descriptor of the current staged copy, -1 if it is not staged.

        The one way its users get one (the reader, the look-ahead, the peer server,
        the scrub): kept open once opened, reopened when a new copy replaced it. Does
        not block when it is open already; opening may (OSError: out of descriptors,
        a failing disk)."""
        gen = self._state[chunk]
        if gen != 0 and self._fd_gen[chunk] == gen:
            return self._fds[chunk]
        return self.open_fd(chunk) if gen != 0 else -1

    def cached_fd(self, chunk: int) -> int:
        """The open fd of the current staged copy, or -1 (absent, or not opened by this
        process): whether a descriptor handed out earlier is still the current copy's."""
        gen = self._state[chunk]
        if gen != 0 and self._fd_gen[chunk] == gen:
            return self._fds[chunk]
        return -1

    def open_fd(self, chunk: int) -> int:
        """Open (or reopen) the current staged copy; -1 if it is not staged. May block.
        Callers want `fd`, which opens only when needed.

        Threads of one process may call it at once (the peer server's, the reader's
        pool): a lock keeps one from closing an fd another has just handed out.
        """
        with self._open_lock:
            gen = self._state[chunk]
            if gen == 0:
                return -1
            if self._fds[chunk] >= 0:
                if self._fd_gen[chunk] == gen:
                    return self._fds[chunk]  # another thread opened it meanwhile
                # The superseded copy's fd stays open until close(): a disk thread may be
                # about to read it, and a closed number is handed out again at once (to
                # the new copy, to any file), so that read, or a later "is this still the
                # current copy?" (ChunkPool.staged_copy_failed, which compares fds), would
                # be about the wrong file. One fd per re-staged chunk: rare.
                self._retired.append(self._fds[chunk])
                self._fds[chunk] = -1
            try:
                fd = os.open(self.path(chunk), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                if self._state[chunk] == gen:  # staged, yet gone (removed behind our
                    self.evict(chunk)  # back): forget it, so it is staged again
                return -1
            self._fds[chunk] = fd
            self._fd_gen[chunk] = gen
            return fd

    def close(self) -> None:
        if self._in_use_fd >= 0:
            touch_last_used(self.dir)
            os.close(self._in_use_fd)
            self._in_use_fd = -1
        for i, fd in enumerate(self._fds):
            if fd >= 0:
                os.close(fd)
                self._fds[i] = -1
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()
        # Release the exports before closing (None: a stray use after close fails loudly).
        self._view = self._adopted_view = None  # type: ignore[assignment]
        self._state.close()
        self._last_gen.close()
        self._adopted.close()


def _chunk_index(filename: str) -> int | None:
    stem, _, ext = filename.partition(".")
    if ext != "chunk" or not stem.isdigit():
        return None
    return int(stem)


def _writer_alive(temp_name: str) -> bool:
    """Whether the process named in a temporary copy's name (see temp_path) still runs: a
    cache dir outlives jobs and is shared by the node's daemons, and a copy another
    daemon is writing right now must not be removed under it."""
    pid = temp_name.rsplit(".", 1)[-1]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)

"""Tier: where a checkpoint store's node-local copy lives, and who may use it.

`CACHE_DIR/ckpt/<key>/` with key = a hash of the checkpoint store's real path, so
the next mount of the same checkpoint dir on this node finds what the last one
did not drain (resume). Inside: `tree/` (the files the job sees under
`MOUNTPOINT/ckpt/`), `state.db` (dlfsd.ckpt.state), `store` (the store's path, for
an admin), `.lock` (held by the mount for its lifetime: one mount per checkpoint
dir per node), `.mutate` (serialises a change of the tree's names with the drain's
publish of a file and with the adoption of the store's entries, see dlfsd.ckpt.drain
and dlfsd.ckpt.tree).

Hidden temporary names (never shown under `ckpt/`): `.NAME.dlfs-drain-HOST-RANDOM`
on the store (a drain, or a symlink mirrored, before its rename into place) and
`.dlfs-adopt-RANDOM` in the local tree (a placeholder of a store entry before
its state is recorded; a crash leaves one behind, removed at the next open). The
store's root also holds `.dlfs-sums/` (dlfsd.ckpt.sums), never shown either.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import secrets
import socket
import stat
from pathlib import Path

from dlfs.errors import DlfsError
from dlfsd.ckpt.nodelock import NodeLock
from dlfsd.ckpt.state import CkptState

TIER_DIR = "ckpt"
TMP_MARK = b".dlfs-drain-"  # store: `.NAME.dlfs-drain-HOST-RANDOM`
ADOPT_MARK = b".dlfs-adopt-"  # local tree: `.dlfs-adopt-RANDOM`


def tmp_name(name: bytes) -> bytes:
    """A hidden name beside `name` on the store, with this host's name in it (so a
    mount removes only its own leftovers, never another node's drain in progress)."""
    host = socket.gethostname().encode(errors="replace").replace(b".", b"_")[:32]
    return b"." + name + TMP_MARK + host + b"-" + secrets.token_hex(4).encode()


def adopt_name() -> bytes:
    """A hidden local name for a placeholder being made (short: any name fits beside)."""
    return ADOPT_MARK + secrets.token_hex(4).encode()


def is_drain_temporary(name: bytes) -> bool:
    """A name on the store that is a copy in progress, never an entry to show."""
    return name.startswith(b".") and TMP_MARK in name


def is_adopt_temporary(name: bytes) -> bool:
    return name.startswith(b".") and ADOPT_MARK in name


def tier_path(cache_dir: str, store: str) -> Path:
    """The node-local directory of checkpoint store `store` under `cache_dir`."""
    key = hashlib.sha256(os.path.realpath(store).encode(errors="surrogateescape")).hexdigest()
    return Path(cache_dir) / TIER_DIR / key[:16]


class Tier:
    """A checkpoint store and its local tier, opened (and locked) for one mount."""

    def __init__(self, cache_dir: str, store: str) -> None:
        self.store = os.path.realpath(store)
        self.root = tier_path(cache_dir, store)
        self.tree = self.root / "tree"
        try:
            self.tree.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.tree, 0o755)  # the mount's owner sees it as its own (--uid)
            (self.root / "store").write_text(self.store + "\n")
        except OSError as err:
            raise DlfsError(f"cannot create the checkpoint tier {self.root}: {err.strerror}; "
                            "check --cache-dir") from None
        self._lock_fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise DlfsError(f"checkpoint store {self.store} is already mounted on this node "
                            f"(its tier {self.root} is in use); unmount that mount first, or "
                            "use another --ckpt-store") from None
        self.tree_bytes = os.fsencode(self.tree)
        self.store_bytes = os.fsencode(self.store)
        self.root_ino = os.lstat(self.tree).st_ino
        #: Which extents of the store's copies the workers checked (dlfsd.ckpt.sums),
        #: one small file per copy read; emptied at each mount.
        self.checked_bytes: bytes | None = os.fsencode(self.root / "checked")
        self.state = CkptState(str(self.root / "state.db"))
        #: (uid, gid) the entries made on the store get (a root daemon mounting for a
        #: job's user, --uid); set by dlfsd.ckpt.drain.Drainer, before the fork.
        self.owner: tuple[int, int] | None = None
        self._tidy()
        # Bumped whenever an entry is removed or replaced: every process then closes the
        # descriptors it keeps (a new file may reuse a removed one's inode number).
        self.epoch = mmap.mmap(-1, 16)  # [epoch, full: the local copies reached the limit]
        self._mutate = NodeLock(str(self.root / ".mutate"))

    def _tidy(self) -> None:
        """Before any process uses the tier (the lock is ours): remove placeholders a
        crash left under their temporary names, and drop the state of inodes no longer
        in the tree (a crash between a removal and its bookkeeping), so that a new file
        reusing such an inode number never inherits an old file's state."""
        inos = {self.root_ino}
        for directory, dirs, files in os.walk(self.tree_bytes):
            for name in dirs + files:
                path = os.path.join(directory, name)
                if is_adopt_temporary(name):
                    with contextlib.suppress(OSError):
                        os.rmdir(path) if name in dirs and not os.path.islink(path) \
                            else os.unlink(path)
                    continue
                with contextlib.suppress(OSError):
                    inos.add(os.lstat(path).st_ino)
            dirs[:] = [d for d in dirs if not is_adopt_temporary(d)]
        self.state.keep_only(inos)
        try:
            os.makedirs(self.checked_bytes, mode=0o700, exist_ok=True)
            for name in os.listdir(self.checked_bytes):  # checked again by this mount
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.checked_bytes, name))
        except OSError:
            self.checked_bytes = None  # each worker checks for itself

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def bump_epoch(self) -> None:
        view = memoryview(self.epoch).cast("Q")
        view[0] += 1
        view.release()

    def current_epoch(self) -> int:
        return int.from_bytes(self.epoch[:8], "little")

    def set_full(self, full: bool) -> None:
        """--ckpt-limit reached: writes wait (dlfsd.ckpt.tree), the drain evicts."""
        self.epoch[8:16] = int(full).to_bytes(8, "little")

    def full(self) -> bool:
        return self.epoch[8] != 0

    def mutating(self) -> NodeLock:
        """Held around a change of names in the tree (and its mirror on the store) and
        around the drain's publish of a file: the drain then publishes each file at the
        path it has when the rename is done, never at one a rename just gave up."""
        return self._mutate

    def relpath(self, path: bytes) -> bytes:
        """`path` (in the tree) relative to the tree's root."""
        return path[len(self.tree_bytes) + 1:]

    def store_path(self, relpath: bytes) -> bytes:
        return os.path.join(self.store_bytes, relpath) if relpath else self.store_bytes

    def store_reachable(self) -> bool:
        """The store's directory is there: "missing on the store" then means removed,
        not a store file system that is not mounted (whose mount point looks empty)."""
        try:
            return stat.S_ISDIR(os.stat(self.store_bytes).st_mode)
        except OSError:
            return False

    def makedirs_on_store(self, directory: bytes) -> None:
        """A directory on the store (and those above it), given to `owner` if made."""
        if os.path.isdir(directory):
            return
        self.makedirs_on_store(os.path.dirname(directory))
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o755)
            if self.owner is not None:
                os.chown(directory, *self.owner)

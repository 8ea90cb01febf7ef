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
from dlfsd.ckpt.beneath import Beneath
from dlfsd.ckpt.creds import Creds
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

    def __init__(self, cache_dir: str, store: str, creds: Creds | None = None) -> None:
        """`creds`: the job user's (dlfsd.ckpt.creds); every operation on the local tree
        and on the store runs with them (None: the daemon's own)."""
        self.store = os.path.realpath(store)
        self.root = tier_path(cache_dir, store)
        self.tree = self.root / "tree"
        self.creds = creds if creds is not None else Creds.none()
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)  # the tier's state: the daemon's alone
            self._make_tree()
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
        #: The local tree and the store, reached only through these (dlfsd.ckpt.beneath):
        #: by descriptors, no symlink followed, as the job's user.
        self.local = Beneath(self.tree, self.creds,
                             os.open(self.tree, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
                                     | os.O_CLOEXEC))
        self.store_fs = Beneath(self.store, self.creds)
        self._check_store()
        self.root_ino = self.local.lstat(b"").st_ino
        #: Which extents of the store's copies the workers checked (dlfsd.ckpt.sums),
        #: one small file per copy read; emptied at each mount.
        self.checked_bytes: bytes | None = os.fsencode(self.root / "checked")
        self.state = CkptState(str(self.root / "state.db"))
        self._tidy()
        # Bumped whenever an entry is removed or replaced: every process then closes the
        # descriptors it keeps (a new file may reuse a removed one's inode number).
        self.epoch = mmap.mmap(-1, 16)  # [epoch, full: the local copies reached the limit]
        self._mutate = NodeLock(str(self.root / ".mutate"))

    def _check_store(self) -> None:
        """A store that exists must be one the job's user can list and enter: the tier
        reaches it only with the user's credentials (a missing one may be mounted or
        made later; until then `ckpt/` shows this node's files)."""
        try:
            with self.store_fs.directory(b"", listing=True):
                pass
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as err:
            raise DlfsError(f"checkpoint store {self.store} cannot be used as "
                            f"{self.creds.describe()}: {err.strerror}; give the job's user "
                            "a directory of its own there (the Slurm prolog makes it)") from None

    def _make_tree(self) -> None:
        """`tree/`, owned by the job's user (its entries are made with the user's
        credentials). One left by a mount for another user is refused: its files are
        that user's checkpoints. One made by root (a mount without --uid, or before the
        tier acted as the user) is handed over, entry by entry, never through a link."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.tree, 0o700)
        fd = os.open(self.tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            owner = os.fstat(fd).st_uid
            uid, gid = self.creds.uid, self.creds.gid
            if self.creds.active and owner != uid:
                if owner != 0:
                    raise DlfsError(
                        f"the checkpoint tier {self.root} holds the checkpoints of uid "
                        f"{owner}, not of uid {uid}: drain them (mount it for that user and "
                        "run `dlfs flush`) or remove the tier, or use another --ckpt-store")
                _hand_over(fd, uid, gid)
            os.fchmod(fd, 0o755)  # the mount's owner sees it as its own (--uid)
        finally:
            os.close(fd)

    def _tidy(self) -> None:
        """Before any process uses the tier (the lock is ours): remove placeholders a
        crash left under their temporary names, and drop the state of inodes no longer
        in the tree (a crash between a removal and its bookkeeping), so that a new file
        reusing such an inode number never inherits an old file's state."""
        inos = {self.root_ino}
        for directory, entries in self.local.walk():
            for name, st in entries:
                if is_adopt_temporary(name):
                    with contextlib.suppress(OSError):
                        rel = os.path.join(directory, name) if directory else name
                        if stat.S_ISDIR(st.st_mode):
                            self.local.rmdir(rel)
                        else:
                            self.local.unlink(rel)
                else:
                    inos.add(st.st_ino)
        self.state.keep_only(inos)
        checked = os.fsencode(self.root / "checked")
        try:
            os.makedirs(checked, mode=0o700, exist_ok=True)
            for name in os.listdir(checked):  # checked again by this mount
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(checked, name))
        except OSError:
            self.checked_bytes = None  # each worker checks for itself

    def close(self) -> None:
        self.local.close()
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

    def store_reachable(self) -> bool:
        """The store's directory is there: "missing on the store" then means removed,
        not a store file system that is not mounted (whose mount point looks empty)."""
        return self.store_fs.isdir(b"")

    def makedirs_on_store(self, directory: bytes) -> None:
        """Directory `directory` (relative) on the store and those above it, made where
        missing, as the job's user (so the user owns them)."""
        self.store_fs.makedirs(directory)


def _hand_over(fd: int, uid: int, gid: int) -> None:
    """Give directory `fd` and everything below it to uid:gid (root's tree of an earlier
    mount), by descriptors: nothing is followed."""
    os.fchown(fd, uid, gid)
    for name in os.listdir(fd):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                            | os.O_CLOEXEC, dir_fd=fd)
            try:
                _hand_over(child, uid, gid)
            finally:
                os.close(child)

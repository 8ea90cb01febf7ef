"""Tier: where a checkpoint store's node-local copy lives, and who may use it.

`CACHE_DIR/ckpt/<key>/` with key = a hash of the checkpoint store's real path, so
the next mount of the same checkpoint dir on this node finds what the last one
did not drain (resume). Inside: `tree/` (the files the job sees under
`MOUNTPOINT/ckpt/`), `state.db` (dlfsd.ckpt.state), `store` (the store's path, for
an admin), `.lock` (held by the mount for its lifetime: one mount per checkpoint
dir per node), `.mutate` (serialises a change of the tree's names with the drain's
publish of a file, see dlfsd.ckpt.drain).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import threading
from pathlib import Path

from dlfs.errors import DlfsError
from dlfsd.ckpt.state import CkptState

TIER_DIR = "ckpt"


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
        self.root_ino = os.lstat(self.tree).st_ino
        self.state = CkptState(str(self.root / "state.db"))
        # Bumped whenever an entry is removed or replaced: every process then closes the
        # descriptors it keeps (a new file may reuse a removed one's inode number).
        self.epoch = mmap.mmap(-1, 16)  # [epoch, full: the local copies reached the limit]
        self._mutate_path = self.root / ".mutate"
        self._mutate: tuple[int, int] | None = None  # (pid, fd)
        self._mutate_thread = threading.Lock()

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

    @contextlib.contextmanager
    def mutating(self):
        """Held around a change of names in the tree (and its mirror on the store) and
        around the drain's publish of a file: the drain then publishes each file at the
        path it has when the rename is done, never at one a rename just gave up."""
        with self._mutate_thread:
            if self._mutate is None or self._mutate[0] != os.getpid():
                fd = os.open(self._mutate_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self._mutate = (os.getpid(), fd)
            fd = self._mutate[1]
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def relpath(self, path: bytes) -> bytes:
        """`path` (in the tree) relative to the tree's root."""
        return path[len(self.tree_bytes) + 1:]

    def store_path(self, relpath: bytes) -> bytes:
        return os.path.join(os.fsencode(self.store), relpath)

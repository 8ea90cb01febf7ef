"""The store: a directory (usually on the parallel file system) of published datasets.

Layout: STORE/NAME/manifest.dlfs + STORE/NAME/chunks/*.chunk. A dataset is
published by renaming a fully written temporary directory (STORE/.tmp-...) to
NAME, so readers see either the whole dataset or nothing. Names starting with
a dot are never datasets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlfs.errors import DlfsError, NotFoundError, UsageError
from dlfs.procs import pid_alive
from dlfs.signals import signals_deferred
from dlfs.store.directory import SampleDirectory
from dlfs.store.format import CHUNK_HEADER_SIZE, MANIFEST_NAME, chunk_path, decode_manifest

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
TMP_PREFIX = ".tmp-"  # a populate writing
OLD_PREFIX = ".old-"  # a whole dataset moved aside while --force puts its successor in place
RM_PREFIX = ".rm-"  # a dataset being deleted (partly deleted if its remover died)


def check_dataset_name(name: str) -> str:
    """Dataset names become top-level directory names under every mount."""
    if not _NAME_RE.fullmatch(name):
        raise UsageError(
            f"invalid dataset name {name!r}: use 1-128 letters, digits, '.', '_', '+', '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass
class Dataset:
    """A published dataset: its metadata and its in-memory sample directory."""

    name: str
    path: Path
    uuid: bytes
    created: float
    chunk_size: int
    chunk_lengths: np.ndarray
    directory: SampleDirectory
    stats: dict

    @property
    def chunk_count(self) -> int:
        return len(self.chunk_lengths)

    def chunk_path(self, index: int) -> Path:
        return chunk_path(self.path, index)


def manifest_body(name: str, dataset_uuid: bytes, chunk_size: int, chunk_lengths: np.ndarray,
                  directory: SampleDirectory, stats: dict) -> dict:
    return {
        "name": name,
        "uuid": dataset_uuid,
        "created": time.time(),
        "chunk_size": chunk_size,
        "chunk_lengths": np.asarray(chunk_lengths, dtype="<u8").tobytes(),
        "stats": stats,
        "directory": directory.to_manifest(),
    }


def dataset_from_manifest(path: Path, body: dict) -> Dataset:
    """The dataset at `path`. Its name is its directory's, the one `ls`, `info` and
    `--dataset` go by: the name in the manifest is the one it was populated under, and
    a dataset directory copied or renamed within the store (imagenet -> imagenet-v2)
    would otherwise appear twice under the old name in a mount, the second one out
    of reach."""
    return Dataset(
        name=path.name,
        path=path,
        uuid=body["uuid"],
        created=body["created"],
        chunk_size=body["chunk_size"],
        chunk_lengths=np.frombuffer(body["chunk_lengths"], dtype="<u8"),
        directory=SampleDirectory.from_manifest(body["directory"]),
        stats=body["stats"],
    )


class Store:
    """A store directory; all paths the CLI and the daemon touch go through here."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def require(self) -> Store:
        if not self.path.is_dir():
            if self.path.exists():
                raise DlfsError(f"store {self.path} is not a directory (check --store)")
            raise NotFoundError(f"store not found: {self.path} (create it, or check --store)")
        return self

    def dataset_names(self) -> list[str]:
        self.require()
        try:
            names = os.listdir(self.path)
        except OSError as err:
            raise DlfsError(f"cannot list store {self.path}: {err.strerror}") from None
        # A directory that is no valid name (a copy, "x copy") is not a dataset.
        return sorted(n for n in names if _NAME_RE.fullmatch(n)
                      and (self.path / n / MANIFEST_NAME).is_file())

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.path / name)

    def check_replaceable(self, name: str) -> None:
        """`name` may be replaced by a new dataset only if it is one: a directory that
        someone put in the store under that name is not ours to delete."""
        if self.exists(name) and not (self.path / name / MANIFEST_NAME).is_file():
            raise DlfsError(f"{self.path / name} exists but is not a DLFS dataset (it has no "
                            f"{MANIFEST_NAME}); move it out of the store or choose another name")

    def open(self, name: str) -> Dataset:
        check_dataset_name(name)
        path = self.path / name
        manifest = path / MANIFEST_NAME
        try:
            raw = manifest.read_bytes()
        except FileNotFoundError:
            self.require()
            raise NotFoundError(
                f"dataset {name!r} not found in store {self.path} "
                f"(`dlfs ls --store {self.path}` lists them)"
            ) from None
        except OSError as err:
            raise DlfsError(f"cannot read manifest {manifest}: {err.strerror}") from None
        return dataset_from_manifest(path, decode_manifest(raw, manifest))

    def check_unmounted(self, name: str, doing: str) -> None:
        """Refuse to `doing` (remove, replace) dataset `name` while a mount on this node
        serves it: its readers would get EIO midway through an epoch, from whichever
        worker no longer has the deleted chunk files open."""
        from dlfs.store.inuse import mounts_using

        mounts = mounts_using(self.path, name)
        if mounts:
            mountpoint, pid = mounts[0]
            more = f" (and {len(mounts) - 1} more mounts)" if len(mounts) > 1 else ""
            raise DlfsError(f"cannot {doing} dataset {name!r}: it is mounted at {mountpoint} "
                            f"(daemon {pid}){more}; run `dlfs umount {mountpoint}` first")

    def remove(self, name: str) -> None:
        """Unpublish first (rename away), then delete, so no reader sees half a dataset.

        A dataset that is a symbolic link (to one published elsewhere) loses only the
        link here: what it points to belongs to the other store.
        """
        check_dataset_name(name)
        path = self.path / name
        self.check_replaceable(name)
        if not (path / MANIFEST_NAME).is_file():
            self.open(name)  # raises the not-found error with the hint
        self.check_unmounted(name, "remove")
        if path.is_symlink():
            path.unlink()
            return
        doomed = self.path / f"{RM_PREFIX}{name}.{_owner_tag()}"
        os.rename(path, doomed)
        try:
            shutil.rmtree(doomed)
        except OSError as err:
            raise DlfsError(f"dataset {name!r} is removed from the store, but deleting its "
                            f"files failed ({err.strerror}: {err.filename}); delete {doomed} "
                            "by hand") from None
        except KeyboardInterrupt:  # Ctrl-C on a slow delete (many chunks on a PFS)
            raise KeyboardInterrupt(f"dataset {name!r} is removed from the store, but its "
                                    f"files are only partly deleted: delete {doomed} by "
                                    "hand") from None

    # -- publishing --------------------------------------------------------
    def temp_dir_path(self, name: str) -> Path:
        """Where a populate of `name` by this process writes before publishing."""
        return self.path / f"{TMP_PREFIX}{name}.{_owner_tag()}"

    def publish(self, tmp: Path, name: str, replace: bool) -> None:
        """Atomically make `tmp` visible as `name` (replacing an old one if asked).

        Replacing takes two renames (the old one aside, the new one in place). If the
        second fails, the old one is put back; signals are held across both; and
        if the process is killed between them, the next populate of `name` puts the
        old one back (clean_stale_temps). So `name` never ends up missing.
        """
        final = self.path / name
        if not self.exists(name):
            os.rename(tmp, final)
            self._sync_published(name)
            return
        if not replace:
            raise DlfsError(f"dataset {name!r} already exists in {self.path} "
                            "(use --force to replace it)")
        self.check_replaceable(name)
        old = self.path / f"{OLD_PREFIX}{name}.{_owner_tag()}"
        published = False
        try:
            with signals_deferred():  # a signal held here is raised on leaving...
                os.rename(final, old)
                try:
                    os.rename(tmp, final)
                except BaseException:
                    os.rename(old, final)
                    raise
                published = True
                self._sync_published(name)
        finally:  # ...and the replaced dataset is deleted all the same
            if published:
                _delete(old)

    def _sync_published(self, name: str) -> None:
        try:
            fsync_path(self.path)
        except OSError as err:
            raise DlfsError(f"published dataset {name!r}, but could not sync the store "
                            f"directory {self.path} ({err.strerror}): a crash of the store's "
                            "server now could undo it; check with `dlfs ls`") from None

    def clean_stale_temps(self, name: str) -> list[Path]:
        """Clear leftovers of earlier populates and removals of `name` on this host whose
        process died: remove them, except a whole dataset moved aside by a `--force`
        populate killed before its successor took the name, which is put back."""
        removed = []
        host = _host()
        for prefix in (TMP_PREFIX, OLD_PREFIX, RM_PREFIX):
            for path in self.path.glob(f"{prefix}{name}.*"):
                parts = path.name[len(prefix) + len(name) + 1 :].split(".")
                if len(parts) < 3 or parts[0] != host or not parts[1].isdigit():
                    continue
                if pid_alive(int(parts[1])):
                    continue
                if prefix == OLD_PREFIX and self._restore(path, name):
                    continue
                _delete(path)
                removed.append(path)
        return removed

    def _restore(self, old: Path, name: str) -> bool:
        """Put a dataset moved aside back as `name` if the name is free and it is whole."""
        final = self.path / name
        if final.exists() or not _whole_dataset(old):
            return False
        try:
            os.rename(old, final)
        except OSError:
            return False
        log.warning("put dataset %r back: a replacing populate died before publishing "
                    "(it was left as %s)", name, old.name)
        return True


def _delete(path: Path) -> None:
    """Delete a leftover, whatever it is: a dataset replaced by `--force` may have been a
    symbolic link to one published elsewhere, and only the link is ours."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _whole_dataset(path: Path) -> bool:
    """A readable manifest, and every chunk file it names, whole (size checked)."""
    try:
        body = decode_manifest((path / MANIFEST_NAME).read_bytes(), path / MANIFEST_NAME)
        lengths = np.frombuffer(body["chunk_lengths"], dtype="<u8")
        return all(chunk_path(path, i).stat().st_size == CHUNK_HEADER_SIZE + int(n)
                   for i, n in enumerate(lengths))
    except (OSError, DlfsError, KeyError, TypeError, ValueError):
        return False


def _host() -> str:
    return socket.gethostname().replace(".", "_")


def _owner_tag() -> str:
    """host.pid.random: lets a later run tell whether a leftover's writer is dead."""
    return f"{_host()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

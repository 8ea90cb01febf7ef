"""The store: a directory (usually on the parallel file system) of published datasets.

Layout: STORE/NAME/manifest.dlfs + STORE/NAME/chunks/*.chunk. A dataset is
published by renaming a fully written temporary directory (STORE/.tmp-...) to
NAME, so readers see either the whole dataset or nothing. Names starting with
a dot are never datasets.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlfs.directory import SampleDirectory
from dlfs.errors import DlfsError, NotFoundError, UsageError
from dlfs.format import MANIFEST_NAME, chunk_path, decode_manifest
from dlfs.runtime import pid_alive

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


def check_dataset_name(name: str) -> str:
    """Dataset names become top-level directory names under every mount."""
    if not _NAME_RE.match(name):
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
    return Dataset(
        name=body["name"],
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
            raise NotFoundError(f"store not found: {self.path} (create it, or check --store)")
        return self

    def dataset_names(self) -> list[str]:
        self.require()
        try:
            names = os.listdir(self.path)
        except OSError as err:
            raise DlfsError(f"cannot list store {self.path}: {err.strerror}") from None
        return sorted(n for n in names if not n.startswith(".")
                      and (self.path / n / MANIFEST_NAME).is_file())

    def exists(self, name: str) -> bool:
        return (self.path / name).exists()

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

    def remove(self, name: str) -> None:
        """Unpublish first (rename away), then delete, so no reader sees half a dataset."""
        check_dataset_name(name)
        path = self.path / name
        if not (path / MANIFEST_NAME).is_file():
            self.open(name)  # raises the not-found error with the hint
        doomed = self.path / f"{OLD_PREFIX}{name}.{_owner_tag()}"
        os.rename(path, doomed)
        shutil.rmtree(doomed)

    # -- publishing --------------------------------------------------------
    def temp_dir_path(self, name: str) -> Path:
        """Where a populate of `name` by this process writes before publishing."""
        return self.path / f"{TMP_PREFIX}{name}.{_owner_tag()}"

    def publish(self, tmp: Path, name: str, replace: bool) -> None:
        """Atomically make `tmp` visible as `name` (replacing an old one if asked)."""
        final = self.path / name
        old: Path | None = None
        if final.exists():
            if not replace:
                raise DlfsError(f"dataset {name!r} already exists in {self.path} "
                                "(use --force to replace it)")
            old = self.path / f"{OLD_PREFIX}{name}.{_owner_tag()}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def clean_stale_temps(self, name: str) -> list[Path]:
        """Remove leftovers of earlier populates of `name` on this host whose process died."""
        removed = []
        host = _host()
        for prefix in (TMP_PREFIX, OLD_PREFIX):
            for path in self.path.glob(f"{prefix}{name}.*"):
                parts = path.name[len(prefix) + len(name) + 1 :].split(".")
                if len(parts) < 3 or parts[0] != host or not parts[1].isdigit():
                    continue
                if not pid_alive(int(parts[1])):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        return removed


def _host() -> str:
    return socket.gethostname().replace(".", "_")


def _owner_tag() -> str:
    """host.pid.random: lets a later run tell whether a leftover's writer is dead."""
    return f"{_host()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

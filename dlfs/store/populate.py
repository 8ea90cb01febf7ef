"""`dlfs populate`: pack a source tree into a new dataset in the store.

Scan (already in row order, dlfs.store.scan) -> plan (pure arithmetic,
dlfs.store.layout) -> copy the extents into the chunk files with `jobs` worker
processes (dlfs.store.packer: per-file work is Python calls that hold the GIL,
and a source on a slow file system needs many reads in flight) -> write the
manifest -> publish by one rename. Any failure removes the temporary
directory; a killed process leaves only a dot-named leftover that the next
populate of the same name on this host cleans.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlfs.errors import DlfsError, UsageError
from dlfs.store.directory import SampleDirectory, chunk_lengths, display_path
from dlfs.store.format import (
    CHUNK_DIR,
    DEFAULT_CHUNK_SIZE,
    MANIFEST_NAME,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    encode_manifest,
)
from dlfs.store.packer import copy_extents
from dlfs.store.scan import check_source, scan_tree
from dlfs.store.store import Dataset, Store, check_dataset_name, fsync_path, manifest_body

log = logging.getLogger(__name__)

# Worker processes when --jobs is not given: two per core, at most this many (each
# has up to packer.AHEAD reads in flight already; more only on request).
MAX_DEFAULT_JOBS = 16


def default_jobs(sharing: int = 1) -> int:
    """Worker processes of a populate by default: two per core this process may run on,
    the cores shared among `sharing` populates on the node (MPI ranks), at most
    MAX_DEFAULT_JOBS. Processes, not threads: the per-file work holds the GIL
    (dlfs.store.packer). Two per core, because a worker spends part of its time
    blocked (a source read the disk has not delivered, a page-cache write held up by
    writeback): measured on 2 cores with the page cache dropped, 4 workers copied
    200,000 x 2.5 KB files 10% faster than 2, and 20,000 x 110 KiB 10-50% faster."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_JOBS, 2 * cores // max(1, sharing)))


@dataclass(frozen=True)
class PopulateOptions:
    chunk_size: int = DEFAULT_CHUNK_SIZE
    jobs: int | None = None  # None: default_jobs()
    force: bool = False
    fsync: bool = True
    progress: bool | None = None  # None: only when stderr is a terminal


def check_options(options: PopulateOptions) -> None:
    if not MIN_CHUNK_SIZE <= options.chunk_size <= MAX_CHUNK_SIZE:
        raise UsageError(f"--chunk-size must be between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} "
                         f"bytes, got {options.chunk_size}")
    if options.jobs is not None and options.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {options.jobs}")


@dataclass(frozen=True)
class PopulatePlan:
    """Everything decided before any byte is copied: the tree, its chunk layout, the
    temporary directory. Pure data, so MPI rank 0 can hand it to the others."""

    source: Path
    name: str
    directory: SampleDirectory  # checksums still zero
    dataset_uuid: bytes
    stats: dict
    tmp: Path


def populate(source: Path, store: Store, name: str, options: PopulateOptions) -> Dataset:
    """Pack `source` into `store` as dataset `name`; return the published dataset."""
    plan = plan_populate(source, store, name, options)
    try:
        start_temp_dir(plan)
        checksums = write_chunks(source, plan.tmp, plan.directory, plan.dataset_uuid, options)
        publish_dataset(store, plan, checksums, options)
    except OSError as err:
        shutil.rmtree(plan.tmp, ignore_errors=True)
        raise store_error(err, store) from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (the CLI turns it into this)
        shutil.rmtree(plan.tmp, ignore_errors=True)
        raise KeyboardInterrupt(interrupted_outcome(store, plan)) from None
    except BaseException:
        shutil.rmtree(plan.tmp, ignore_errors=True)
        raise
    return store.open(name)


def interrupted_outcome(store: Store, plan: PopulatePlan) -> str:
    """What an interrupted populate leaves: the rename that publishes may have happened
    just before (the old dataset's deletion after it takes a while)."""
    try:
        published = store.open(plan.name).uuid == plan.dataset_uuid
    except DlfsError:
        published = False
    return f"dataset {plan.name!r} was published" if published else "nothing was published"


def plan_populate(source: Path, store: Store, name: str, options: PopulateOptions) -> PopulatePlan:
    """Check the arguments, scan the source and lay out the dataset (nothing written yet)."""
    check_options(options)
    check_dataset_name(name)
    check_source(source)
    _check_store_outside(store, source)
    _check_store_writable(store)
    store.clean_stale_temps(name)  # first: it may put back a dataset a killed run moved
    store.check_replaceable(name)
    if store.exists(name) and not options.force:
        raise DlfsError(f"dataset {name!r} already exists in {store.path} "
                        "(use --force to replace it)")
    if store.exists(name):
        store.check_unmounted(name, "replace")

    scan = scan_tree(source, options.jobs or default_jobs())
    if scan.skipped:
        log.warning("skipped %d special files (sockets, fifos, devices): %s",
                    len(scan.skipped), _some_paths(scan.skipped))
    if scan.vanished:
        log.warning("%d entries were deleted while the source was scanned and are not "
                    "packed: %s", len(scan.vanished), _some_paths(scan.vanished))
    directory = scan.directory(options.chunk_size)
    stats = _stats(directory, len(scan.skipped),
                   display_path(os.fsencode(os.path.abspath(source))))
    # The temp dir is named before it exists, so cleanup never misses it.
    return PopulatePlan(source, name, directory, uuid.uuid4().bytes, stats,
                        store.temp_dir_path(name))


def _check_store_outside(store: Store, source: Path) -> None:
    """A store inside its source would be packed into the dataset (the chunk files
    being written, and every dataset populated there before)."""
    if store.path.resolve().is_relative_to(source.resolve()):
        raise DlfsError(f"store {store.path} is inside the source {source}: the dataset "
                        "would pack the store itself; put the store outside the source")


def _some_paths(paths: list[bytes], shown: int = 10) -> str:
    text = ", ".join(display_path(p) for p in paths[:shown])
    return text + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def start_temp_dir(plan: PopulatePlan) -> None:
    plan.tmp.mkdir()
    (plan.tmp / CHUNK_DIR).mkdir()


def publish_dataset(store: Store, plan: PopulatePlan, checksums: np.ndarray,
                    options: PopulateOptions) -> None:
    """Write the manifest next to the finished chunks and publish by one rename."""
    if options.force and store.exists(plan.name):  # again: the copy may have taken hours
        store.check_unmounted(plan.name, "replace")
    directory = plan.directory.with_checksums(checksums)
    body = manifest_body(plan.name, plan.dataset_uuid, options.chunk_size,
                         chunk_lengths(directory), directory, plan.stats)
    _write_file(plan.tmp / MANIFEST_NAME, encode_manifest(body), options.fsync)
    if options.fsync:
        fsync_path(plan.tmp / CHUNK_DIR)
        fsync_path(plan.tmp)
    store.publish(plan.tmp, plan.name, replace=options.force)


def _check_store_writable(store: Store) -> None:
    try:
        store.path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DlfsError(f"store {store.path} is not a directory (check --store)") from None
    except OSError as err:
        raise DlfsError(f"cannot create store {store.path}: {err.strerror}") from None
    if not os.access(store.path, os.W_OK | os.X_OK):
        raise DlfsError(f"store is not writable: {store.path} (check its permissions)")


def store_error(err: OSError, store: Store) -> DlfsError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DlfsError(f"store is full: {store.path} ({err.strerror}); nothing was published, "
                         "free space or use another --store")
    where = f": {err.filename}" if err.filename else ""
    return DlfsError(f"cannot write to store {store.path} ({err.strerror}{where}); "
                     "nothing was published")


def _stats(directory: SampleDirectory, skipped: int, source: str) -> dict:
    kinds = directory.arrays["mode"] & 0o170000
    files = kinds == stat.S_IFREG
    return {
        "files": int(np.count_nonzero(files)),
        "dirs": int(np.count_nonzero(kinds == stat.S_IFDIR)),
        "symlinks": int(np.count_nonzero(kinds == stat.S_IFLNK)),
        "bytes": int(directory.arrays["size"][files].sum()),
        "skipped": skipped,
        "source": source,
    }


def write_chunks(source: Path, tmp: Path, directory: SampleDirectory, dataset_uuid: bytes,
                 options: PopulateOptions, chunks: np.ndarray | None = None) -> np.ndarray:
    """Copy every extent into chunk files under `tmp`; return the extent checksums.

    With `chunks` (a bool mask over chunk indices) only those chunks are written
    and only their extents' checksums are set (the others stay zero): how MPI
    ranks share the work. The copying itself is dlfs.store.packer's.
    """
    return copy_extents(source, tmp, directory, dataset_uuid, options.jobs or default_jobs(),
                        options.fsync, options.progress, chunks)


def _write_file(path: Path, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())

"""`dlfs populate|ls|info|verify|rm`: make, list, inspect, check and remove the
datasets of a store.

Everything here works on the store directory alone (no daemon, no mount), so it
runs on a login node or under mpirun as well as on a compute node.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dlfs.cli.common import Subparsers, _path, _positive, _size, add_command
from dlfs.errors import (
    EXIT_CORRUPT,
    EXIT_ERROR,
    EXIT_OK,
    DlfsError,
    FormatError,
    FormatVersionError,
    ReportedElsewhere,
)
from dlfs.sizes import format_size
from dlfs.store.directory import display_path
from dlfs.store.format import DEFAULT_CHUNK_SIZE, MANIFEST_NAME
from dlfs.store.populate import PopulateOptions
from dlfs.store.store import Store


def register(subs: Subparsers) -> None:
    """Add the store commands, in the order `dlfs --help` lists them."""
    _add_populate(subs)
    _add_ls(subs)
    _add_info(subs)
    _add_verify(subs)
    _add_rm(subs)


def _add_populate(subs: Subparsers) -> None:
    p = add_command(
        subs, "populate", cmd_populate, "pack a directory tree into a new dataset",
        "examples:\n  dlfs populate ./imagenet --store /lustre/store --name imagenet\n"
        "  dlfs populate ./bert --store /lustre/store --name bert --chunk-size 256M -j 32\n"
        "  mpirun -n 16 dlfs populate /lustre/imagenet --store /lustre/store --name imagenet\n"
        "\nThe dataset appears atomically when complete; an interrupted run publishes "
        "nothing.")
    p.add_argument("source", type=_path, help="directory to pack (read, never modified)")
    p.add_argument("--store", type=_path, required=True,
                   help="store directory (created if missing)")
    p.add_argument("--name", required=True, help="dataset name (letters, digits, . _ + -)")
    p.add_argument("--chunk-size", type=_size, default=DEFAULT_CHUNK_SIZE,
                   help="chunk file size, e.g. 64M (default), 256M, 1G")
    p.add_argument("-j", "--jobs", type=_positive, default=PopulateOptions.jobs,
                   help="worker processes reading the source (default: two per core, at "
                        "most 16, shared by the MPI ranks of a node; more can help on a "
                        "parallel file system with high latency)")
    p.add_argument("--force", action="store_true", help="replace an existing dataset NAME")
    p.add_argument("--no-fsync", action="store_true",
                   help="skip fsync before publishing (faster; for scratch stores only)")
    p.add_argument("--mpi", action="store_true",
                   help="share the work among MPI ranks (automatic under mpirun/srun with "
                        "more than one rank; needs mpi4py)")


def cmd_populate(args: argparse.Namespace) -> int:
    """Pack SOURCE into a new dataset. Under mpirun the ranks share the work and
    only rank 0 prints, so a job's output has one result line, not one per rank."""
    from dlfs.cluster.mpi_populate import launched_by_mpi, mpi_populate
    from dlfs.store.populate import populate

    options = PopulateOptions(chunk_size=args.chunk_size, jobs=args.jobs, force=args.force,
                              fsync=not args.no_fsync)
    started = time.monotonic()
    if args.mpi or launched_by_mpi(os.environ):
        try:
            dataset = mpi_populate(Path(args.source), Store(args.store), args.name, options)
        except ReportedElsewhere:
            return EXIT_ERROR  # rank 0 prints the one line
        if dataset is None:
            return EXIT_OK  # not rank 0: rank 0 reports
    else:
        dataset = populate(Path(args.source), Store(args.store), args.name, options)
    took = time.monotonic() - started
    s = dataset.stats
    print(f"published {dataset.name}: {s['files']} files, {format_size(s['bytes'])} in "
          f"{dataset.chunk_count} chunks, {took:.1f} s "
          f"({format_size(s['bytes'] / max(took, 1e-9))}/s) -> {dataset.path}")
    return EXIT_OK


def _add_ls(subs: Subparsers) -> None:
    p = add_command(
        subs, "ls", cmd_ls, "list the datasets of a store",
        "example:\n  dlfs ls --store /lustre/store")
    p.add_argument("--store", type=_path, required=True)


def cmd_ls(args: argparse.Namespace) -> int:
    """One row per dataset; a damaged manifest is reported after the table instead
    of hiding the datasets that are fine."""
    store = Store(args.store)
    rows = [("NAME", "FILES", "BYTES", "CHUNKS", "CREATED")]
    unreadable = []
    for name in store.dataset_names():
        try:
            d = store.open(name)
        except DlfsError as err:  # one damaged (or just removed) dataset hides no other
            unreadable.append(f"dlfs: error: {err}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(d.created))
        rows.append((name, str(d.stats["files"]), format_size(d.stats["bytes"]),
                     str(d.chunk_count), created))
    if len(rows) == 1 and not unreadable:
        hint = ""
        if (store.path / MANIFEST_NAME).is_file():
            hint = (f" ({store.path} is a dataset; its store is the directory above: "
                    f"dlfs ls --store {store.path.parent})")
        print(f"no datasets in {store.path}{hint}", file=sys.stderr)
        return EXIT_OK
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    for line in unreadable:
        print(line, file=sys.stderr)
    return EXIT_ERROR if unreadable else EXIT_OK


def _add_info(subs: Subparsers) -> None:
    p = add_command(
        subs, "info", cmd_info, "show one dataset's details",
        "example:\n  dlfs info --store /lustre/store imagenet")
    p.add_argument("--store", type=_path, required=True)
    p.add_argument("name")


def cmd_info(args: argparse.Namespace) -> int:
    """What the manifest records about one dataset, one `key: value` line each."""
    d = Store(args.store).open(args.name)
    s = d.stats
    lines = [
        ("name", d.name),
        ("path", str(d.path)),
        ("created", time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(d.created))),
        ("source", s["source"]),
        ("files", str(s["files"])),
        ("directories", str(s["dirs"])),
        ("symlinks", str(s["symlinks"])),
        ("bytes", f"{s['bytes']} ({format_size(s['bytes'])})"),
        ("chunks", f"{d.chunk_count} of up to {format_size(d.chunk_size)}"),
        ("extents", str(d.directory.extent_count)),
        ("directory memory", format_size(d.directory.nbytes())),
        ("skipped specials", str(s["skipped"])),
        ("uuid", d.uuid.hex()),
    ]
    for key, value in lines:
        print(f"{key + ':':<18} {value}")
    return EXIT_OK


def _add_verify(subs: Subparsers) -> None:
    p = add_command(
        subs, "verify", cmd_verify,
        "re-read every chunk of a dataset, check every checksum, name corrupt files",
        "example:\n  dlfs verify --store /lustre/store imagenet")
    p.add_argument("--store", type=_path, required=True)
    p.add_argument("name")
    p.add_argument("-j", "--jobs", type=_positive, default=4, help="chunks checked in parallel")


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 3, not 1, for corrupt data, so a script tells it from a missing store;
    a damaged manifest is corrupt data too, one from another version is not."""
    from dlfs.store.verify import verify_dataset

    try:
        d = Store(args.store).open(args.name)
    except FormatError as err:  # the manifest is part of the dataset: corrupt data too,
        if not isinstance(err, FormatVersionError):  # unless another version wrote it
            err.exit_code = EXIT_CORRUPT
        raise
    report = verify_dataset(d, jobs=args.jobs)
    for error in report.chunk_errors:
        print(f"chunk error: {error}")
    for path in report.corrupt_files:
        print(f"corrupt: {display_path(path)}")
    if report.ok:
        print(f"ok: {d.name}: {d.chunk_count} chunks, {format_size(report.checked_bytes)} checked")
        return EXIT_OK
    print(f"dlfs: error: {d.name}: {len(report.corrupt_files)} corrupt files, "
          f"{len(report.chunk_errors)} bad chunks; re-populate it", file=sys.stderr)
    return EXIT_CORRUPT


def _add_rm(subs: Subparsers) -> None:
    p = add_command(
        subs, "rm", cmd_rm, "remove a dataset from a store",
        "example:\n  dlfs rm --store /lustre/store imagenet")
    p.add_argument("--store", type=_path, required=True)
    p.add_argument("name")


def cmd_rm(args: argparse.Namespace) -> int:
    """Remove a dataset; the store refuses one that a mount still serves."""
    Store(args.store).remove(args.name)
    print(f"removed {args.name} from {args.store}")
    return EXIT_OK

"""`dlfs`: the admin and user command line.

Every subcommand is `main(argv) -> int`: errors print one line
(`dlfs: error: what, which path, what to do`) and exit non-zero; no
tracebacks for anything a user can cause.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dlfs import __version__
from dlfs.config import MountConfig, default_workers
from dlfs.directory import display_path
from dlfs.errors import (
    EXIT_CORRUPT,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    DlfsError,
)
from dlfs.format import DEFAULT_CHUNK_SIZE
from dlfs.populate import PopulateOptions
from dlfs.sizes import format_size, parse_size
from dlfs.store import Store

EXIT_CODES = """exit codes:
  0    success
  1    error (missing or unreadable path, store problem, mount failed)
  2    usage error (bad flag or value)
  3    verify found corrupt data
  130  interrupted
"""

MAIN_EPILOG = """examples:
  dlfs populate /lustre/imagenet --store /lustre/dlfs-store --name imagenet --jobs 16
  dlfs ls --store /lustre/dlfs-store
  dlfs mount /mnt/dlfs --store /lustre/dlfs-store
  ls /mnt/dlfs/imagenet/train | head
  dlfs umount /mnt/dlfs

""" + EXIT_CODES


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line too, with a pointer to --help."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"dlfs: error: {message} (see `{self.prog} --help`)\n")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except DlfsError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _id(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a numeric id, got {text!r}")
    return int(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


# -- subcommands ---------------------------------------------------------------
def cmd_populate(args: argparse.Namespace) -> int:
    from dlfs.mpi_populate import FailedElsewhere, launched_by_mpi, mpi_populate
    from dlfs.populate import populate

    options = PopulateOptions(chunk_size=args.chunk_size, jobs=args.jobs, force=args.force,
                              fsync=not args.no_fsync)
    started = time.monotonic()
    if args.mpi or launched_by_mpi(os.environ):
        try:
            dataset = mpi_populate(Path(args.source), Store(args.store), args.name, options)
        except FailedElsewhere:
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


def cmd_ls(args: argparse.Namespace) -> int:
    store = Store(args.store)
    rows = [("NAME", "FILES", "BYTES", "CHUNKS", "CREATED")]
    for name in store.dataset_names():
        d = store.open(name)
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(d.created))
        rows.append((name, str(d.stats["files"]), format_size(d.stats["bytes"]),
                     str(d.chunk_count), created))
    if len(rows) == 1:
        print(f"no datasets in {store.path}", file=sys.stderr)
        return EXIT_OK
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
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


def cmd_verify(args: argparse.Namespace) -> int:
    from dlfs.verify import verify_dataset

    d = Store(args.store).open(args.name)
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


def cmd_rm(args: argparse.Namespace) -> int:
    Store(args.store).remove(args.name)
    print(f"removed {args.name} from {args.store}")
    return EXIT_OK


def apply_slurm(args: argparse.Namespace, env: dict[str, str]) -> None:
    """`mount --slurm`: take this job's node list, this node and its port from the
    environment (dlfs.slurm), and expand %j/%n in the paths, before anything else
    looks at the flags."""
    from dlfs.slurm import expand_pattern, job_from_env, peer_nodes

    job = job_from_env(env)
    peers = peer_nodes(job, args.port_base, args.node_host)
    args.mountpoint = expand_pattern(args.mountpoint, job.job_id, job.node)
    if args.log_file:
        args.log_file = expand_pattern(args.log_file, job.job_id, job.node)
    args.slurm_nodes = ",".join(peer.spec() for peer in peers)
    args.slurm_node = job.node
    logging.getLogger("dlfs").info("slurm job %s: node %s of %s", job.job_id, job.node,
                                   args.slurm_nodes)


def cmd_mount(args: argparse.Namespace) -> int:
    from dlfs.mountctl import mount

    if args.slurm:
        apply_slurm(args, dict(os.environ))
    config = MountConfig(
        mountpoint=args.mountpoint, store=os.path.abspath(args.store),
        datasets=tuple(args.dataset or ()), verify=not args.no_verify,
        workers=args.workers, io_threads=args.io_threads, max_tasks=args.max_tasks,
        cache_timeout=args.cache_timeout, read_ahead_kb=args.read_ahead_kb,
        allow_other=args.allow_other, uid=args.uid, gid=args.gid, debug=args.debug,
        log_file=os.path.abspath(args.log_file) if args.log_file else None)
    return mount(config, foreground=args.foreground, timeout=args.timeout)


def cmd_slurm_secret(args: argparse.Namespace) -> int:
    from dlfs.slurm import derive_job_secret, read_site_key, write_secret_file

    secret = derive_job_secret(read_site_key(args.key_file), str(args.job_id))
    write_secret_file(args.out, secret, args.uid, args.gid)
    return EXIT_OK


def cmd_umount(args: argparse.Namespace) -> int:
    from dlfs.mountctl import umount

    return umount(args.mountpoint, lazy=args.lazy, timeout=args.timeout)


def cmd_demo(args: argparse.Namespace) -> int:
    from dlfs.demo import run_demo

    return run_demo(args.files, args.mean_size, args.workers,
                    Path(args.workdir) if args.workdir else None, args.keep)


# -- parser --------------------------------------------------------------------
def _sub(subs, name: str, func: Callable, help_: str, epilog: str) -> argparse.ArgumentParser:
    p = subs.add_parser(name, help=help_, description=help_, epilog=epilog + "\n" + EXIT_CODES,
                        formatter_class=_Formatter)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dlfs", formatter_class=_Formatter, epilog=MAIN_EPILOG,
        description="DLFS packs datasets of many small samples into large chunk files and "
                    "serves them through a read-only FUSE mount.")
    parser.add_argument("--version", action="version", version=f"dlfs {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                 parser_class=_Parser)

    p = _sub(subs, "populate", cmd_populate, "pack a directory tree into a new dataset",
             "examples:\n  dlfs populate ./imagenet --store /lustre/store --name imagenet\n"
             "  dlfs populate ./bert --store /lustre/store --name bert --chunk-size 256M -j 32\n"
             "  mpirun -n 16 dlfs populate /lustre/imagenet --store /lustre/store --name imagenet\n"
             "\nThe dataset appears atomically when complete; an interrupted run publishes "
             "nothing.")
    p.add_argument("source", help="directory to pack (read, never modified)")
    p.add_argument("--store", required=True, help="store directory (created if missing)")
    p.add_argument("--name", required=True, help="dataset name (letters, digits, . _ + -)")
    p.add_argument("--chunk-size", type=_size, default=DEFAULT_CHUNK_SIZE,
                   help="chunk file size, e.g. 64M (default), 256M, 1G")
    p.add_argument("-j", "--jobs", type=_positive, default=PopulateOptions.jobs,
                   help="parallel source readers (default 4; more helps on a parallel file "
                        "system with high latency, fewer on a local disk with few cores)")
    p.add_argument("--force", action="store_true", help="replace an existing dataset NAME")
    p.add_argument("--no-fsync", action="store_true",
                   help="skip fsync before publishing (faster; for scratch stores only)")
    p.add_argument("--mpi", action="store_true",
                   help="share the work among MPI ranks (automatic under mpirun/srun with "
                        "more than one rank; needs mpi4py)")

    p = _sub(subs, "ls", cmd_ls, "list the datasets of a store",
             "example:\n  dlfs ls --store /lustre/store")
    p.add_argument("--store", required=True)

    p = _sub(subs, "info", cmd_info, "show one dataset's details",
             "example:\n  dlfs info --store /lustre/store imagenet")
    p.add_argument("--store", required=True)
    p.add_argument("name")

    p = _sub(subs, "verify", cmd_verify,
             "re-read every chunk of a dataset, check every checksum, name corrupt files",
             "example:\n  dlfs verify --store /lustre/store imagenet")
    p.add_argument("--store", required=True)
    p.add_argument("name")
    p.add_argument("-j", "--jobs", type=_positive, default=4, help="chunks checked in parallel")

    p = _sub(subs, "rm", cmd_rm, "remove a dataset from a store",
             "example:\n  dlfs rm --store /lustre/store imagenet")
    p.add_argument("--store", required=True)
    p.add_argument("name")

    p = _sub(subs, "mount", cmd_mount,
             "mount the datasets of a store read-only at MOUNTPOINT/<dataset>/",
             "examples:\n  dlfs mount /mnt/dlfs --store /lustre/store\n"
             "  dlfs mount /mnt/dlfs --store /lustre/store --dataset imagenet --dataset bert\n"
             "  dlfs mount /mnt/dlfs --store /lustre/store --foreground --debug\n"
             "  dlfs mount '/mnt/dlfs/%j' --slurm --store /lustre/store --uid 1000 --gid 100\n"
             "\nWithout --foreground this returns once the mount answers; the daemon keeps "
             "running\nin its own session and logs to --log-file (default: "
             "/run/dlfs/<id>.log for root).")
    p.add_argument("mountpoint")
    p.add_argument("--store", required=True)
    p.add_argument("--dataset", action="append", metavar="NAME",
                   help="mount only this dataset (repeatable; default: all)")
    p.add_argument("--foreground", action="store_true", help="run the daemon in this process")
    p.add_argument("--debug", action="store_true", help="log every FUSE request")
    p.add_argument("--no-verify", action="store_true",
                   help="do not check checksums on first read (trusts the store)")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users read the mount (needs user_allow_other for non-root)")
    p.add_argument("--uid", type=_id,
                   help="show every file as owned by this user and let only them (and root) "
                        "enter: root dir 0700, allow_other (the Slurm prolog mounts for the "
                        "job's user)")
    p.add_argument("--gid", type=_id, help="group shown for every file (with --uid)")
    p.add_argument("--slurm", action="store_true",
                   help="inside a Slurm job or prolog: nodes, this node and its port from "
                        "the job's environment; %%j (job id) and %%n (node) in paths expand")
    p.add_argument("--port-base", type=_positive, default=7000,
                   help="with --slurm: node i of the job listens on PORT_BASE + i "
                        "(default 7000)")
    p.add_argument("--node-host", default="%n", metavar="PATTERN",
                   help="with --slurm: address of each node, %%n = node name (default %%n; "
                        "127.0.0.1 for simulated nodes on one host)")
    p.add_argument("--workers", type=_positive, default=default_workers(),
                   help="daemon processes serving requests (default: cores, at least 4, "
                        "at most 8)")
    p.add_argument("--io-threads", type=_positive, default=16,
                   help="threads for blocking disk reads (default 16)")
    p.add_argument("--max-tasks", type=_positive, default=64,
                   help="FUSE requests served concurrently (default 64)")
    p.add_argument("--cache-timeout", type=float, default=86400.0,
                   help="seconds the kernel may cache names and attributes (default 86400)")
    p.add_argument("--read-ahead-kb", type=int, default=4096,
                   help="kernel read-ahead for large sequential reads (default 4096; "
                        "0 keeps the kernel's 128; needs root)")
    p.add_argument("--log-file", help="daemon log file")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the mount to come up (default 120)")

    p = _sub(subs, "umount", cmd_umount,
             "unmount and wait for the daemon to exit (also cleans a dead daemon's mount)",
             "examples:\n  dlfs umount /mnt/dlfs\n  dlfs umount --lazy /mnt/dlfs")
    p.add_argument("mountpoint")
    p.add_argument("--lazy", action="store_true", help="detach now even if files are open")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait for the daemon to exit before killing it")

    p = _sub(subs, "slurm-secret", cmd_slurm_secret,
             "write a job's secret (HMAC of the site key and the job id) 0600 for its user",
             "example (in the prolog, as root):\n"
             "  dlfs slurm-secret --key-file /etc/dlfs/site.key --job-id $SLURM_JOB_ID \\\n"
             "      --out /run/dlfs-slurm/$SLURM_JOB_ID/secret --uid $SLURM_JOB_UID "
             "--gid $SLURM_JOB_GID\n"
             "\nEvery node of a job derives the same secret; no node needs to talk to another.")
    p.add_argument("--key-file", required=True, help="site key (root-only, mode 0600)")
    p.add_argument("--job-id", required=True, type=_id, help="the Slurm job id")
    p.add_argument("--out", required=True, help="secret file to write (replaced atomically)")
    p.add_argument("--uid", type=_id, help="owner of the secret file (the job's user)")
    p.add_argument("--gid", type=_id, help="group of the secret file")

    p = _sub(subs, "demo", cmd_demo,
             "generate a dataset, pack it, mount it, read it like a training epoch, unmount",
             "examples:\n  dlfs demo\n  dlfs demo --files 20000 --workers 4 --keep")
    p.add_argument("--files", type=_positive, default=4000, help="samples to generate (4000)")
    p.add_argument("--mean-size", type=_size, default=110 * 1024,
                   help="mean sample size (110K, like ImageNet JPEGs)")
    p.add_argument("--workers", type=_positive, default=4, help="reader processes (4)")
    p.add_argument("--workdir", help="where to put source, store and mountpoint (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return parser


def _terminate(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="dlfs: %(levelname)s: %(message)s")
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)  # clean up temp files like on Ctrl-C
    try:
        return args.func(args)
    except DlfsError as err:
        print(f"dlfs: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("dlfs: interrupted; nothing was published", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:
        where = f": {err.filename}" if err.filename else ""
        print(f"dlfs: error: {err.strerror or err}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""`dlfs`: the admin and user command line.

Every subcommand is `main(argv) -> int`: errors print one line
(`dlfs: error: what, which path, what to do`) and exit non-zero; no
tracebacks for anything a user can cause.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
from pathlib import Path

from dlfs import __version__
from dlfs.cli import mount_cmds, obs_cmds, store_cmds
from dlfs.cli.common import (
    EXIT_CODES,
    HelpFormatter,
    Parser,
    _id,
    _path,
    _port,
    _positive,
    _size,
    add_command,
    node_items,
)
from dlfs.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PIPE_CLOSED,
    DlfsError,
    UsageError,
)
from dlfs.store.directory import display_path

MAIN_EPILOG = """examples:
  dlfs populate /lustre/imagenet --store /lustre/dlfs-store --name imagenet --jobs 16
  dlfs ls --store /lustre/dlfs-store
  dlfs mount /mnt/dlfs --store /lustre/dlfs-store
  ls /mnt/dlfs/imagenet/train | head
  dlfs umount /mnt/dlfs

  # a job's nodes as one chunk pool (same flags on every node)
  dlfs mount /mnt/dlfs --store /lustre/dlfs-store --cache-dir /nvme/dlfs \\
      --nodes-file nodes.txt --secret-file job.secret
  dlfs status /mnt/dlfs --watch

""" + EXIT_CODES


# -- subcommands ---------------------------------------------------------------
def cmd_slurm_secret(args: argparse.Namespace) -> int:
    from dlfs.cluster.slurm import derive_job_secret, read_site_key, write_secret_file

    secret = derive_job_secret(read_site_key(args.key_file), str(args.job_id))
    write_secret_file(args.out, secret, args.uid, args.gid)
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from dlfs.cli.doctor import doctor

    return doctor(args.store, args.cache_dir, args.port, nodes=node_items(args),
                  node=args.node, secret_file=args.secret_file)


def cmd_demo(args: argparse.Namespace) -> int:
    from dlfs.cli.demo import run_demo

    if args.mean_size < 1:
        raise UsageError("--mean-size must be at least 1 byte")

    return run_demo(args.files, args.mean_size, args.workers,
                    Path(args.workdir) if args.workdir else None, args.keep)


# -- parser --------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dlfs", formatter_class=HelpFormatter, epilog=MAIN_EPILOG,
        description="DLFS packs datasets of many small samples into large chunk files and "
                    "serves them through a read-only FUSE mount.")
    parser.add_argument("--version", action="version", version=f"dlfs {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                 parser_class=Parser)

    store_cmds.register(subs)

    mount_cmds.register(subs)

    obs_cmds.register(subs)

    p = add_command(subs, "slurm-secret", cmd_slurm_secret,
             "write a job's secret (HMAC of the site key and the job id) 0600 for its user",
             "example (in the prolog, as root):\n"
             "  dlfs slurm-secret --key-file /etc/dlfs/site.key --job-id $SLURM_JOB_ID \\\n"
             "      --out /run/dlfs-slurm/$SLURM_JOB_ID/secret --uid $SLURM_JOB_UID "
             "--gid $SLURM_JOB_GID\n"
             "\nEvery node of a job derives the same secret; no node needs to talk to another.")
    p.add_argument("--key-file", type=_path, required=True,
                   help="site key (root-only, mode 0600)")
    p.add_argument("--job-id", required=True, type=_id, help="the Slurm job id")
    p.add_argument("--out", type=_path, required=True,
                   help="secret file to write (replaced atomically)")
    p.add_argument("--uid", type=_id, help="owner of the secret file (the job's user)")
    p.add_argument("--gid", type=_id, help="group of the secret file")

    p = add_command(subs, "doctor", cmd_doctor,
             "check that this node can mount DLFS: FUSE, dependencies, store, cache dir, port",
             "examples:\n  dlfs doctor\n"
             "  dlfs doctor --store /lustre/store --cache-dir /local/nvme/dlfs --port 7000\n"
             "  dlfs doctor --nodes-file nodes.txt --secret-file job.secret\n"
             "\nOne line per check (ok / warn / FAIL with what to do); exit code 1 if any "
             "failed.")
    p.add_argument("--store", type=_path, help="also check this store and every dataset's manifest")
    p.add_argument("--cache-dir", type=_path,
                   help="also check this cache dir is writable with free space")
    p.add_argument("--port", type=_port, help="also check this peer port is free")
    p.add_argument("--nodes", action="append", metavar="NAME=HOST:PORT,...",
                   help="also check a pool's node list (as for mount): this node is in it, "
                        "its port is free")
    p.add_argument("--nodes-file", type=_path, help="the node list from a file, as for mount")
    p.add_argument("--node", help="this node's NAME in the list (default: the host name)")
    p.add_argument("--secret-file", type=_path,
                   help="also check a pool's secret file (mode 0600, long enough)")

    p = add_command(subs, "demo", cmd_demo,
             "generate a dataset, pack it, mount it, read it like a training epoch, unmount",
             "examples:\n  dlfs demo\n  dlfs demo --files 20000 --workers 4 --keep")
    p.add_argument("--files", type=_positive, default=4000, help="samples to generate (4000)")
    p.add_argument("--mean-size", type=_size, default=110 * 1024,
                   help="mean sample size (110K, like ImageNet JPEGs)")
    p.add_argument("--workers", type=_positive, default=4, help="reader processes (4)")
    p.add_argument("--workdir", type=_path,
                   help="make the demo's directory (source, store, mountpoint) in here, and "
                        "remove it at the end (default: /var/tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return parser


def _terminate(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="dlfs: %(levelname)s: %(message)s")
    # Paths are printed as Python holds them: bytes that are not UTF-8 as lone
    # surrogates, which a strict UTF-8 stdout (any UTF-8 locale) refuses to print.
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # clean up temp files like on Ctrl-C
        signal.signal(sig, _terminate)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe must meet the handler below
        return code
    except DlfsError as err:
        print(f"dlfs: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as err:  # a populate says what it left (see populate)
        print(f"dlfs: interrupted{f'; {err}' if str(err) else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError as err:
        if not _stdout_closed():
            return _os_error(err)
        # `dlfs verify ... | head`: whoever read our output is gone, which is no error
        # of ours to report; stop quietly, as a tool killed by SIGPIPE would.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    except OSError as err:
        return _os_error(err)


def _os_error(err: OSError) -> int:
    name = err.filename
    where = f": {display_path(name) if isinstance(name, bytes) else name}" if name else ""
    print(f"dlfs: error: {err.strerror or err}{where}", file=sys.stderr)
    return 1


def _stdout_closed() -> bool:
    """Our stdout is a pipe or socket whose reader has gone (POLLERR, POLLHUP)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP)
                   for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())

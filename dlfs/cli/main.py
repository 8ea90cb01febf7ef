"""`dlfs`: the admin and user command line: the top-level parser, and main().

The commands live in one module per family (store_cmds, mount_cmds, obs_cmds,
setup_cmds), each owning its flags and handlers; this module only creates the
parser, lets each family register its commands (FAMILIES), and runs the one
that was asked for. Every handler is `cmd_<name>(args) -> exit code`; main()
turns whatever a user can cause into one line (`dlfs: error: what, which path,
what to do`) and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
from collections.abc import Callable

from dlfs import __version__
from dlfs.cli import (
    cache_cmds,
    ckpt_cmds,
    mount_cmds,
    obs_cmds,
    order_cmds,
    setup_cmds,
    store_cmds,
    warmup_cmds,
)
from dlfs.cli.common import EXIT_CODES, HelpFormatter, Parser, Subparsers
from dlfs.errors import EXIT_INTERRUPTED, EXIT_PIPE_CLOSED, DlfsError
from dlfs.launch import daemon_version_line
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


# The command families, in the order `dlfs --help` lists their commands. A new
# family is a module dlfs/cli/<family>_cmds.py whose register(subs) adds its
# commands (common.add_command, common's argument types); add it here.
# tests/test_layering.py puts it between common and this shell by itself.
FAMILIES: tuple[Callable[[Subparsers], None], ...] = (
    store_cmds.register,  # populate ls info verify rm
    mount_cmds.register,  # mount placement status umount
    obs_cmds.register,  # stats trace report
    setup_cmds.register,  # slurm-secret slurm-ckpt-dir doctor demo
    order_cmds.register,  # order
    cache_cmds.register,  # cache
    warmup_cmds.register,  # warmup
    ckpt_cmds.register,  # flush ckpt-audit
)


class VersionAction(argparse.Action):
    """`dlfs --version`: this release, and the daemon's as `dlfs mount` would start it
    (a node with a mixed install shows two releases, or a daemon that cannot start)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default,
                         help=help or "show the versions of dlfs and of its daemon, and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        print(f"dlfs {__version__} ({here})\n{daemon_version_line()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The `dlfs` parser: the top level here, every command from its family."""
    parser = Parser(
        prog="dlfs", formatter_class=HelpFormatter, epilog=MAIN_EPILOG,
        description="DLFS packs datasets of many small samples into large chunk files and "
                    "serves them through a read-only FUSE mount.")
    parser.add_argument("--version", action=VersionAction)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                 parser_class=Parser)
    for register in FAMILIES:
        register(subs)
    return parser


def _terminate(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """The `dlfs` entry point (pyproject.toml [project.scripts]): run one command and
    return its exit code; the one place where errors become one line on stderr."""
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

"""What every command family of `dlfs` shares: the parser classes, the argument
types, the exit-code table every help text ends with, and adding one subcommand.

One copy, so every command checks a path, a size or a port the same way and
fails with the same one line. The argument types keep the names they had in
dlfs/cli/main.py: argparse prints a type's __name__ when it raises ValueError
(`invalid _id value: '²'`: '²'.isdigit() is true but int('²') fails), so the
names are part of what the command line prints.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from dlfs.errors import EXIT_USAGE, DlfsError
from dlfs.sizes import parse_size
from dlfs.store.store import check_dataset_name

# The `add_subparsers()` object a family's register() adds its commands to.
Subparsers = argparse._SubParsersAction

EXIT_CODES = """exit codes:
  0    success
  1    error (missing or unreadable path, store problem, mount failed)
  2    usage error (bad flag or value)
  3    verify found corrupt data
  4    ckpt-audit: a checkpoint tier holds files not on the checkpoint store
  5    ckpt-audit: a checkpoint tier is in use by a mount
  6    ckpt-audit: a checkpoint tier's ledger cannot be read (drained or not: unknown)
  130  interrupted
  141  stopped: its output pipe was closed (e.g. `| head`)
"""

MAX_CACHE_TIMEOUT = 10 * 365 * 86400  # --cache-timeout: ten years is "forever" enough
MAX_ID = 2**32 - 2  # uid_t/gid_t; 2**32 - 1 is (uid_t) -1, "no change" to chown
MIN_SECONDS, MAX_SECONDS = 0.001, 1e6  # beyond: a busy loop, or sleep/select overflow
MAX_TRACE_CAPACITY = 1 << 26  # records: ~3.3 GB of shared memory, allocated at mount


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs keep their line breaks: they are example command lines and tables."""


class Parser(argparse.ArgumentParser):
    """Usage errors are one line too, with a pointer to --help."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"dlfs: error: {message} (see `{self.prog} --help`)\n")


def add_command(subs: Subparsers, name: str, func: Callable[[argparse.Namespace], int],
                help_: str, epilog: str) -> argparse.ArgumentParser:
    """Add subcommand `name` run by `func(args) -> exit code`; every command's help
    shows the same help line, its examples (`epilog`) and the exit-code table."""
    p = subs.add_parser(name, help=help_, description=help_, epilog=epilog + "\n" + EXIT_CODES,
                        formatter_class=HelpFormatter)
    p.set_defaults(func=func)
    return p


def node_items(args: argparse.Namespace) -> list[str]:
    """The node list of --nodes and --nodes-file together (mount, placement, doctor)."""
    from dlfs.cluster.nodes import read_nodes_file

    return list(args.nodes or ()) + (read_nodes_file(args.nodes_file) if args.nodes_file else [])


# -- argument types: each raises ArgumentTypeError, which argparse prints as one line
def _size(text: str) -> int:
    try:
        return parse_size(text)
    except DlfsError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _id(text: str) -> int:
    if not text.isdigit() or int(text) > MAX_ID:
        raise argparse.ArgumentTypeError(f"must be a numeric id, 0 to {MAX_ID}, got {text!r}")
    return int(text)


def _non_negative(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text!r}")
    return value


def _timeout(text: str) -> float:
    """Seconds the kernel may cache: FUSE carries them as whole seconds (u64) plus ns."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_CACHE_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be 0 to {MAX_CACHE_TIMEOUT:.0f} seconds, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """A wait, timeout or interval: positive and finite (0 would busy-loop or fail at
    once, NaN compares false with everything)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not MIN_SECONDS <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be {MIN_SECONDS:g} to {MAX_SECONDS:g} seconds, got {text!r}")
    return value


def _port(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {text!r}")
    return value


def _path(text: str) -> str:
    """A path argument: an empty one (an unset variable in a script) would mean the
    current directory, and `dlfs mount "$MNT"` would cover it without a word."""
    if not text:
        raise argparse.ArgumentTypeError("is empty: give a path (an unset variable?)")
    return text


def _dataset_name(text: str) -> str:
    try:
        return check_dataset_name(text)
    except DlfsError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _trace_capacity(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if not 1 <= value <= MAX_TRACE_CAPACITY:
        raise argparse.ArgumentTypeError(
            f"must be 1 to {MAX_TRACE_CAPACITY} records (~50 bytes of memory each), "
            f"got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value

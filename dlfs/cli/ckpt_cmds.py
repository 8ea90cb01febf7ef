"""`dlfs flush`: wait until checkpoints written so far are on the checkpoint store.

The daemon (dlfsd.ckpt.control) queues what is not drained yet at once, closed or
not; this command then asks every half second how much is left, shows it, and
returns once nothing written before it started is missing from the store, or
fails in one line after --timeout naming what is not drained (it stays in the
node cache; nothing is deleted).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dlfs.cli.common import Subparsers, _path, _seconds, add_command
from dlfs.errors import EXIT_OK, DlfsError, UsageError
from dlfs.runtime import mountpoint_path
from dlfs.sizes import format_size

POLL = 0.2  # seconds between questions (each walks the checkpoint dir once)


def register(subs: Subparsers) -> None:
    p = add_command(
        subs, "flush", cmd_flush,
        "wait until the checkpoints written so far are on the checkpoint store",
        "examples:\n  dlfs flush /mnt/dlfs\n  dlfs flush /mnt/dlfs /mnt/dlfs/ckpt/step-1000\n"
        "  dlfs flush /mnt/dlfs --timeout 600\n"
        "\nfsync() on a file in MOUNTPOINT/ckpt/ makes it durable on this node (the\n"
        "local copy); this command makes everything written before it durable on the\n"
        "store (docs/CKPT.md).")
    p.add_argument("mountpoint", type=_path)
    p.add_argument("path", type=_path, nargs="?",
                   help="only this file or directory under MOUNTPOINT/ckpt/ (default: all)")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help="give up after this many seconds (exit 1, naming what is left); "
                        "default: wait as long as it takes")
    p.add_argument("--quiet", action="store_true", help="no progress line")


def cmd_flush(args: argparse.Namespace) -> int:
    from dlfs.obs.traceclient import _connect, _request

    mountpoint = mountpoint_path(args.mountpoint)
    under = _relative(mountpoint, args.path)
    word = under.hex() if under else "-"
    with _connect(args.mountpoint) as sock:
        started = _request(sock, f"ckpt-flush {word}")[0]
    since, store = started["since"], started["store"]
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    show = not args.quiet and sys.stderr.isatty()
    first = None
    while True:
        with _connect(args.mountpoint) as sock:
            left = _request(sock, f"ckpt-pending {word} {since}")[0]
        if first is None:
            first = left["bytes"]
        if not left["files"]:
            if show:
                sys.stderr.write("\r\033[K")
            print(f"flushed: checkpoints written so far are on {store}")
            return EXIT_OK
        if show:
            done = max(first - left["bytes"], 0)
            trouble = f"; store trouble: {left['error']}" if left["error"] else ""
            sys.stderr.write(f"\r\033[Kdraining to {store}: {left['files']} files, "
                             f"{format_size(left['bytes'])} left ({format_size(done)} "
                             f"done){trouble}")
            sys.stderr.flush()
        if deadline is not None and time.monotonic() > deadline:
            if show:
                sys.stderr.write("\n")
            names = ", ".join(left["names"]) + (" ..." if left["files"] > len(left["names"])
                                                else "")
            why = f" (last error: {left['error']})" if left["error"] else ""
            raise DlfsError(f"{left['files']} checkpoint files ({format_size(left['bytes'])}) "
                            f"not on {store} after {args.timeout:g} s{why}: {names}; they "
                            f"stay in the node cache {left['local']}")
        time.sleep(POLL)


def _relative(mountpoint: str, path: str | None) -> bytes | None:
    """PATH relative to MOUNTPOINT/ckpt/ (None: all of it)."""
    if path is None:
        return None
    top = os.path.join(os.fsencode(mountpoint), b"ckpt")
    full = os.fsencode(os.path.abspath(path))
    if full == top:
        return None
    if not full.startswith(top + b"/"):
        raise UsageError(f"{path} is not under {os.fsdecode(top)}/ (dlfs flush takes a path "
                         "in the checkpoint directory)")
    return full[len(top) + 1:]

"""`dlfs flush`: wait until checkpoints written so far are on the checkpoint store;
`dlfs ckpt-audit`: may a node's checkpoint tier be deleted (the Slurm epilog asks).

The daemon (dlfsd.ckpt.control) queues what is not drained yet at once, closed or
not; this command then asks every half second how much is left, shows it, and
returns once nothing written before it started is missing from the store, or
fails in one line after --timeout naming what is not drained (it stays in the
node cache; nothing is deleted).

ckpt-audit reads a tier's ledger (dlfsd.ckpt.audit) without a mount or a daemon: the
epilog, the prolog's failure path and DLFS_CACHE_AFTER_JOB=wipe delete a tier only
when it says drained and not in use, whatever became of the mount.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dlfs.cli.common import Subparsers, _path, _seconds, add_command
from dlfs.errors import (
    EXIT_CKPT_IN_USE,
    EXIT_CKPT_UNDRAINED,
    EXIT_CKPT_UNKNOWN,
    EXIT_OK,
    DlfsError,
    UsageError,
)
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
    _add_audit(subs)


def _add_audit(subs: Subparsers) -> None:
    p = add_command(
        subs, "ckpt-audit", cmd_ckpt_audit,
        "say whether a node cache's checkpoint tiers may be deleted (drained, not in use)",
        "examples (as root, e.g. in the Slurm epilog):\n"
        "  dlfs ckpt-audit --cache-dir /local/dlfs-cache\n"
        "  dlfs ckpt-audit --cache-dir /local/dlfs-cache --ckpt-store /lustre/ckpt/1234\n"
        "\nOne line per tier (CACHE/ckpt/KEY/): `drained KEY: ...`, `undrained KEY: ...`\n"
        "(files not on the checkpoint store, by the tier's ledger), `in-use KEY: ...` (a\n"
        "mount holds it) or `unknown KEY: ...` (its ledger cannot be read). Exit 0 only if\n"
        "every tier is drained and not in use (then it may be deleted); else 5 (in use),\n"
        "6 (unknown) or 4 (undrained), in that order. Reads only: changes nothing.")
    p.add_argument("--cache-dir", type=_path, required=True,
                   help="the node cache (dlfs mount --cache-dir) holding CACHE/ckpt/")
    p.add_argument("--ckpt-store", type=_path,
                   help="only the tier of this checkpoint store (dlfs mount --ckpt-store)")
    p.add_argument("--json", action="store_true", help="one JSON object per tier, per line")


def cmd_ckpt_audit(args: argparse.Namespace) -> int:
    """Thin: dlfsd.ckpt.audit does the reading (lazy import: only this command loads it)."""
    import json

    from dlfsd.ckpt.audit import DRAINED, IN_USE, UNKNOWN, audit_cache

    if not os.path.isdir(args.cache_dir):
        raise DlfsError(f"cache dir not found: {args.cache_dir} (give the --cache-dir of "
                        "the mounts whose checkpoint tiers to audit)")
    audits = audit_cache(args.cache_dir, args.ckpt_store)
    for audit in audits:
        print(json.dumps(audit.as_dict()) if args.json else audit.line())
    if not audits and not args.json:
        which = f" for checkpoint store {args.ckpt_store}" if args.ckpt_store else ""
        print(f"no checkpoint tier{which} in {os.path.join(args.cache_dir, 'ckpt')}")
    verdicts = {audit.verdict for audit in audits}
    if IN_USE in verdicts:
        return EXIT_CKPT_IN_USE
    if UNKNOWN in verdicts:
        return EXIT_CKPT_UNKNOWN
    return EXIT_OK if verdicts <= {DRAINED} else EXIT_CKPT_UNDRAINED


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

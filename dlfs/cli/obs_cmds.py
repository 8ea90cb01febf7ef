"""`dlfs stats|trace|report`: what a mount did, for the user who wants to know
why an epoch is slow.

Thin: the counters and the trace are read and rendered by dlfs.obs (imported
when a command runs, so matplotlib is only needed for `report`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dlfs.cli.common import Subparsers, _path, _seconds, add_command


def register(subs: Subparsers) -> None:
    """Add the observability commands, in the order `dlfs --help` lists them."""
    _add_stats(subs)
    _add_trace(subs)
    _add_report(subs)


def _add_stats(subs: Subparsers) -> None:
    p = add_command(
        subs, "stats", cmd_stats,
        "show the I/O counters of a mount (per dataset: opens, reads, bytes, random share, "
        "request size, sources, latency)",
        "examples:\n  dlfs stats /mnt/dlfs\n  dlfs stats /mnt/dlfs --watch\n"
        "  dlfs stats /mnt/dlfs --json | jq .datasets\n"
        "\nReads MOUNTPOINT/.dlfs/stats.json (Prometheus text: MOUNTPOINT/.dlfs/metrics).")
    p.add_argument("mountpoint", type=_path)
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--interval", type=_seconds, default=1.0,
                   help="seconds between refreshes with --watch (default 1)")
    p.add_argument("--json", action="store_true", help="print the raw stats.json")


def cmd_stats(args: argparse.Namespace) -> int:
    """Thin: dlfs.obs.statsview reads and renders the mount's counters."""
    from dlfs.obs.statsview import show_stats

    return show_stats(args.mountpoint, watch=args.watch, as_json=args.json,
                      interval=args.interval)


def _add_trace(subs: Subparsers) -> None:
    p = add_command(
        subs, "trace", cmd_trace,
        "record every operation on a mount (time, pid, uid, file, offset, size, latency, "
        "source)",
        "examples:\n  dlfs trace start /mnt/dlfs\n  python train.py\n"
        "  dlfs trace stop /mnt/dlfs -o train-trace.csv\n"
        "  dlfs report train-trace.csv -o train-report\n"
        "\nOnly root and the user running the daemon may trace. The trace is a bounded "
        "ring\n(dlfs mount --trace-capacity): beyond it the oldest records are dropped "
        "and\ncounted. Format: docs/TRACE.md.")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("mountpoint", type=_path)
    p.add_argument("-o", "--output", type=_path, metavar="FILE",
                   help="with stop: the CSV file to write (default dlfs-trace-TIME.csv)")


def cmd_trace(args: argparse.Namespace) -> int:
    """Thin: dlfs.obs.traceclient talks to the daemon's control socket."""
    from dlfs.obs.traceclient import run_trace_command

    return run_trace_command(args.action, args.mountpoint, args.output)


def _add_report(subs: Subparsers) -> None:
    p = add_command(
        subs, "report", cmd_report,
        "plot a trace: spatial and temporal patterns, request sizes, sources, "
        "throughput, top files",
        "example:\n  dlfs report train-trace.csv -o train-report\n"
        "  (then open train-report/index.html)\n\nNeeds matplotlib: "
        "pip install 'dlfs[report]'.")
    p.add_argument("trace", type=_path, help="a CSV written by `dlfs trace stop`")
    p.add_argument("-o", "--output", type=_path, default="dlfs-report", metavar="DIR",
                   help="directory for the PNGs, index.html and summary.txt "
                        "(default dlfs-report)")


def cmd_report(args: argparse.Namespace) -> int:
    """Thin, and imported late: only `report` needs matplotlib."""
    from dlfs.obs.report import make_report

    return make_report(Path(args.trace), Path(args.output))

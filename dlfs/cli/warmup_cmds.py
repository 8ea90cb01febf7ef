"""`dlfs warmup`: stage datasets onto the nodes of an allocation before training.

Thin: the placement and the copying are the daemon's (dlfsd.pool.warmup runs its
Stager in the foreground); this module turns flags into a WarmupPlan, shows
progress and prints one summary line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dlfs.cli.common import Subparsers, _path, _positive, _seconds, _size, add_command, node_items
from dlfs.errors import UsageError
from dlfs.sizes import format_size

PROGRESS_EVERY = 5.0  # seconds between progress lines when stderr is not a terminal


def register(subs: Subparsers) -> None:
    """Add `warmup`."""
    p = add_command(
        subs, "warmup", cmd_warmup,
        "stage this node's share of datasets into its cache dir ahead of a job",
        "examples:\n"
        "  srun -N4 dlfs warmup --slurm --store /lustre/dlfs-store imagenet "
        "--cache-dir /local/dlfs-cache\n"
        "  dlfs warmup --store /lustre/dlfs-store --cache-dir /nvme/dlfs "
        "--nodes-file nodes.txt --node n3\n"
        "\nRun it on every node the job will use, with the node list and --replicas the "
        "job's\nmounts will have (placement depends on them): the job's mounts then adopt "
        "the\ncopies, and a job whose nodes were all warmed reads nothing from the store. "
        "Copies\nare checked like the daemon's (every extent) before they count. Without "
        "nodes: a\npool of one (this node stages everything).")
    p.add_argument("datasets", nargs="*", metavar="DATASET",
                   help="datasets to stage (default: every dataset of the store)")
    p.add_argument("--store", type=_path, required=True, help="the store populate wrote")
    p.add_argument("--cache-dir", type=_path, required=True,
                   help="this node's cache dir (the one the mounts use)")
    p.add_argument("--slurm", action="store_true",
                   help="the node list and this node from the Slurm job's environment "
                        "(run under srun); %%n in --cache-dir is the node")
    p.add_argument("--nodes", action="append", metavar="NAME=HOST:PORT,...",
                   help="the job's nodes, as for mount (only the names matter here)")
    p.add_argument("--nodes-file", type=_path, help="file with one NAME=HOST:PORT per line")
    p.add_argument("--node", help="this node's NAME in the list (default: the host name)")
    p.add_argument("--replicas", type=_positive, default=1,
                   help="as the job's mounts will have it (default 1)")
    p.add_argument("--jobs", type=_positive, default=4,
                   help="chunks copied at once (default 4)")
    p.add_argument("--stall-seconds", type=_seconds, default=120.0,
                   help="give up when no chunk got staged for this long (default 120)")
    p.add_argument("--store-bandwidth", type=_size, help=argparse.SUPPRESS)  # benchmarks only


def cmd_warmup(args: argparse.Namespace) -> int:
    from dlfsd.pool.warmup import WarmupPlan, print_progress, warmup

    plan = WarmupPlan(_datasets(args), os.path.abspath(_cache_dir(args)), *_nodes(args),
                      replicas=args.replicas, jobs=args.jobs,
                      store_rate=args.store_bandwidth or 0, stall_seconds=args.stall_seconds)
    result = warmup(plan, _reporter(print_progress))
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    print(f"warm-up of node {plan.node_names[plan.node]}: {result.owned_chunks} chunks "
          f"({format_size(result.owned_bytes)}) are its share; {result.reused_chunks} were "
          f"staged already, {format_size(result.copied_bytes)} copied in "
          f"{result.seconds:.1f} s ({format_size(int(result.rate))}/s)")
    return 0


def _datasets(args: argparse.Namespace):
    from dlfs.store.store import Store

    store = Store(args.store).require()
    names = args.datasets or store.dataset_names()
    if not names:
        raise UsageError(f"the store {args.store} holds no datasets")
    return sorted((store.open(name) for name in names), key=lambda d: d.name)


def _cache_dir(args: argparse.Namespace) -> str:
    if not args.slurm:
        return args.cache_dir
    from dlfs.cluster.slurm import expand_pattern, job_from_env

    job = job_from_env(dict(os.environ))
    return expand_pattern(args.cache_dir, job.job_id, job.node)


def _nodes(args: argparse.Namespace) -> tuple[tuple[str, ...], int]:
    """(node names, this node's index): placement needs names only."""
    if args.slurm:
        if args.nodes or args.nodes_file or args.node:
            raise UsageError("--slurm takes the nodes from the job; drop --nodes, "
                             "--nodes-file and --node")
        from dlfs.cluster.slurm import job_from_env

        job = job_from_env(dict(os.environ))
        return tuple(job.nodes), job.nodes.index(job.node)
    from dlfs.cluster.nodes import default_node_name, parse_nodes, select_self

    items = node_items(args)
    if not items:
        return (args.node or default_node_name(),), 0
    nodes = parse_nodes(items)
    return tuple(n.name for n in nodes), select_self(nodes, args.node)


def _reporter(show):
    """Every progress line on a terminal; one every PROGRESS_EVERY seconds elsewhere."""
    if sys.stderr.isatty():
        return show
    last = [0.0]

    def report(line: str) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY:
            last[0] = now
            show(line)

    return report

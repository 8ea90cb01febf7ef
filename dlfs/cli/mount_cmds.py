"""`dlfs mount|placement|status|umount|stop-daemon`: a mount's life, from the flags that set
up its daemon (and chunk pool) to taking it down again.

The flags are checked here, before any daemon starts, so a mistake fails in one
line instead of in a daemon log; starting and stopping the daemon itself is
dlfs.cli.mountctl. `placement` sits here because it answers, for the same
--nodes and --replicas a pool mount takes, which node would stage what.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from dlfs.cli.common import (
    Subparsers,
    _dataset_name,
    _id,
    _non_negative,
    _path,
    _port,
    _positive,
    _seconds,
    _size,
    _timeout,
    _trace_capacity,
    add_command,
    node_items,
)
from dlfs.config import MountConfig, default_workers
from dlfs.errors import (
    EXIT_ERROR,
    EXIT_OK,
    DlfsError,
    NotMountedError,
    ReportedElsewhere,
    UsageError,
)
from dlfs.runtime import mountpoint_path
from dlfs.sizes import format_size
from dlfs.store.store import Store


def register(subs: Subparsers) -> None:
    """Add the mount commands, in the order `dlfs --help` lists them."""
    _add_mount(subs)
    _add_placement(subs)
    _add_status(subs)
    _add_umount(subs)
    _add_stop_daemon(subs)


def _add_mount(subs: Subparsers) -> None:
    """The command, and what to mount where for whom; the daemon's and the pool's flags follow."""
    p = add_command(
        subs, "mount", cmd_mount,
        "mount the datasets of a store read-only at MOUNTPOINT/<dataset>/",
        "examples:\n  dlfs mount /mnt/dlfs --store /lustre/store\n"
        "  dlfs mount /mnt/dlfs --store /lustre/store --dataset imagenet --dataset bert\n"
        "  dlfs mount /mnt/dlfs --store /lustre/store --foreground --debug\n"
        "  dlfs mount '/mnt/dlfs/%j' --slurm --store /lustre/store --uid 1000 --gid 100\n"
        "  mpirun -n 4 --map-by ppr:1:node dlfs mount --mpi /tmp/dlfs --store /lustre/store "
        "--cache-dir /nvme/dlfs\n"
        "\nWithout --foreground this returns once the mount answers; the daemon keeps "
        "running\nin its own session and logs to --log-file (default: "
        "/run/dlfs/<id>.log for root).")
    p.add_argument("mountpoint", type=_path)
    p.add_argument("--store", type=_path, required=True)
    p.add_argument("--dataset", action="append", metavar="NAME", type=_dataset_name,
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
    _add_daemon_flags(p)
    _add_pool_flags(p)
    _add_ckpt_flags(p)


def _add_ckpt_flags(p: argparse.ArgumentParser) -> None:
    """The checkpoint tier's flags (docs/CKPT.md)."""
    g = p.add_argument_group(
        "checkpoints",
        "With --ckpt-store, MOUNTPOINT/ckpt/ is writable: files written there land in\n"
        "the node-local --cache-dir at its speed, and each file closed after writing is\n"
        "copied to the checkpoint store in the background (complete or not at all).\n"
        "fsync: durable on this node; `dlfs flush MOUNTPOINT`: durable on the store.\n"
        "The datasets stay read-only (EROFS).")
    g.add_argument("--ckpt-store", type=_path, metavar="DIR",
                   help="directory on the store's file system that checkpoints drain to "
                        "(per job; needs --cache-dir; created if missing)")
    g.add_argument("--drain-bandwidth", type=_size, metavar="BYTES/S",
                   help="at most this many bytes/s to the checkpoint store, all copies "
                        "together, e.g. 500M (default: as fast as the store takes them)")
    g.add_argument("--drain-jobs", type=_positive, default=MountConfig.drain_jobs,
                   help="files copied to the checkpoint store at once (default 2)")
    g.add_argument("--ckpt-limit", type=_size, metavar="SIZE",
                   help="the local copies take at most SIZE, e.g. 200G: drained files are "
                        "evicted from the node cache oldest drain first (read from the store "
                        "afterwards); when nothing can go, writes wait for the drain, then "
                        "fail with ENOSPC (default: no limit, nothing evicted)")
    g.add_argument("--ckpt-keep", type=_non_negative, default=MountConfig.ckpt_keep,
                   metavar="N",
                   help="with --ckpt-limit: never evict the N newest checkpoints (entries of "
                        "MOUNTPOINT/ckpt/, by mtime), for a fast restart (default 1)")
    g.add_argument("--ckpt-limit-wait", type=_seconds, default=MountConfig.ckpt_limit_wait,
                   metavar="SECONDS",
                   help="how long a write waits for room under --ckpt-limit before it fails "
                        "with ENOSPC (default 60)")


def _add_daemon_flags(p: argparse.ArgumentParser) -> None:
    """How the daemon serves: processes, kernel caching, read-ahead, log, counters,
    prefetch, splicing, trace, summary, and how long to wait for it to come up."""
    p.add_argument("--workers", type=_positive, default=default_workers(),
                   help="worker processes serving FUSE requests, one request at a time "
                        "each, besides the daemon's main process (default: cores, at least "
                        "4, at most 8; 1 is one worker process: the single-process mode "
                        "--workers 1 used to select is gone, it reached half the workers' "
                        "rate at best)")
    # Tuned the single-process mode; accepted so that old scripts still mount (a warning).
    for gone in ("--io-threads", "--max-tasks"):
        p.add_argument(gone, type=_positive, help=argparse.SUPPRESS)
    p.add_argument("--cache-timeout", type=_timeout, default=86400.0,
                   help="seconds the kernel may cache names and attributes (default 86400)")
    p.add_argument("--read-ahead-kb", type=_non_negative, default=4096,
                   help="kernel read-ahead for large sequential reads (default 4096; "
                        "0 keeps the kernel's 128; needs root)")
    p.add_argument("--log-file", type=_path, help="daemon log file")
    p.add_argument("--no-stats", action="store_true",
                   help="switch the I/O counters and the trace off (to measure their cost)")
    p.add_argument("--prefetch", choices=("auto", "off"), default="auto",
                   help="auto (default): the first time a sample of a chunk is read, read "
                        "the whole chunk file into the page cache in the background (large "
                        "sequential reads instead of many small random ones); for a file "
                        "of a quarter chunk or more, read ahead that file's own bytes, a chunk "
                        "size ahead of its reader, instead; only when the mount has no "
                        "chunk pool and its datasets fit in a quarter of the available "
                        "memory; off: read only what is asked")
    p.add_argument("--no-splice", action="store_true",
                   help="answer large reads by copying the bytes through the daemon instead "
                        "of splicing them from the chunk file (to measure what splicing "
                        "saves)")
    p.add_argument("--count-opens", action="store_true",
                   help="send every open and close to the daemon, so the counters and the "
                        "trace see them (two kernel round trips per file opened). By default "
                        "the kernel opens files itself: a file already in the page cache is "
                        "read without asking the daemon, and only reads are counted")
    p.add_argument("--trace-capacity", type=_trace_capacity,
                   default=MountConfig.trace_capacity,
                   help="trace records kept while tracing (default 1048576, ~52 MB of "
                        "shared memory; beyond it the oldest are dropped)")
    p.add_argument("--summary-file", type=_path, metavar="PATH",
                   help="at unmount, write the final I/O counters and a text summary "
                        "(JSON) to PATH, e.g. for a Slurm epilogue to keep")
    p.add_argument("--stall-seconds", type=_stall_seconds, default=MountConfig.stall_seconds,
                   metavar="SECONDS",
                   help="a read outstanding this long is a stall (a hung peer, a stuck "
                        "store): logged once with what it waits for, counted, shown by "
                        "`dlfs status` and .dlfs/metrics (default 10; 0: not watched; off "
                        "with --no-stats)")
    p.add_argument("--request-timeout", type=_request_timeout,
                   default=MountConfig.request_timeout, metavar="SECONDS",
                   help="abort the mount when the daemon leaves a request unanswered this "
                        "long (a hung or stopped daemon): readers then get an error instead "
                        "of hanging (Linux >= 6.14; the kernel checks every 15 s and takes "
                        "at least 15; default 600; 0: wait forever)")
    p.add_argument("--timeout", type=_seconds, default=120.0,
                   help="seconds to wait for the mount to come up (default 120)")
    _add_lookahead_flags(p)


def _add_lookahead_flags(p: argparse.ArgumentParser) -> None:
    """The look-ahead's flags (docs/ORDER.md): what a sampler's announcement starts."""
    g = p.add_argument_group(
        "look-ahead",
        "A sampler (dlfs.order.sampler.DLFSSampler) announces each epoch's order to the\n"
        "daemon, which then reads the next samples ahead of the readers (from the\n"
        "node's NVMe copy or the store) and stages owned chunks in first-use order.\n"
        "Jobs that announce nothing read as before.")
    g.add_argument("--lookahead", type=_lookahead, default=(MountConfig.lookahead_samples,
                                                          MountConfig.lookahead_bytes),
                   metavar="SAMPLES[:SIZE]",
                   help="fetch at most SAMPLES samples and SIZE bytes ahead of the first "
                        "sample not read yet (default 256:256M); 0 switches the look-ahead "
                        "off (no order socket)")
    g.add_argument("--lookahead-streams", type=_streams, default=MountConfig.lookahead_streams,
                   metavar="[MIN:]MAX",
                   help="samples fetched at once; with a parallel file system each is one "
                        "read stream. The look-ahead starts at MIN and opens more, up to MAX, "
                        "while the readers catch up with it (default 8:32; N alone is "
                        "min(8,N):N; 8:8 keeps 8)")
    g.add_argument("--lookahead-pipeline", type=_on_off, metavar="{on,off}",
                   default=MountConfig.lookahead_pipeline,
                   help="send the peer extents of a fetch thread's samples to their owner "
                        "together, pipelined on one connection: less CPU on the peers that "
                        "serve them (half per sample while it keeps ahead, 16 cores), but "
                        "readers that outrun the look-ahead wait on its rounds (0.76x the "
                        "files/s there with 8 readers as fast as they can). On where the "
                        "peers' CPU is short and the readers paced (GPU-bound training); "
                        "default off: one request at a time per connection")
    g.add_argument("--lookahead-peers", type=_on_off, metavar="{on,off}",
                   default=MountConfig.lookahead_peers,
                   help="fetch the announced samples that only peers hold ahead of the "
                        "readers (default on): hides a slow peer's or network's latency, "
                        "but the node's CPU pays for each twice (the fetch, then the "
                        "reader's copy). off: the readers fetch them themselves; staging, "
                        "store read-ahead and page-cache hints go on. Where the reading "
                        "node's CPU is the bound and peers answer fast, off read an "
                        "announced epoch 1.35x faster (0.78-0.80 of a local one against "
                        "0.58)")
    g.add_argument("--lookahead-stale", type=_seconds, default=MountConfig.lookahead_stale,
                   metavar="SECONDS",
                   help="forget an announced epoch nothing was read from for this long "
                        "(default 60: a killed job's announcement goes away)")


def _replica_wait(text: str) -> float:
    """--replica-wait: 0 (off), or a wait like any other (positive, finite)."""
    with contextlib.suppress(ValueError):
        if float(text) == 0:
            return 0.0
    return _seconds(text)


def _stall_seconds(text: str) -> float:
    """--stall-seconds: 0 (off), or a threshold like any other wait (positive, finite)."""
    with contextlib.suppress(ValueError):
        if float(text) == 0:
            return 0.0
    return _seconds(text)


def _on_off(text: str) -> bool:
    """A switch's value: on or off (the flag's default comes from MountConfig)."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _streams(text: str) -> tuple[int, int]:
    """[MIN:]MAX of --lookahead-streams."""
    low, _, high = text.rpartition(":")
    if not high.isdigit() or (low and not low.isdigit()):
        raise argparse.ArgumentTypeError(f"must be MAX or MIN:MAX, e.g. 8:32, got {text!r}")
    most = int(high)
    least = int(low) if low else min(MountConfig.lookahead_streams[0], most)
    if not 1 <= least <= most:
        raise argparse.ArgumentTypeError(f"must be 1 <= MIN <= MAX, got {text!r}")
    return least, most


def _request_timeout(text: str) -> int:
    """--request-timeout: whole seconds, 0 (none) to 65535 (a u16 in FUSE's INIT)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of seconds: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0 to 65535 seconds, not {value}")
    return value


def _lookahead(text: str) -> tuple[int, int]:
    """SAMPLES[:SIZE] of --lookahead; 0 is off."""
    samples, _, size = text.partition(":")
    if not samples.isdigit():
        raise argparse.ArgumentTypeError(f"must be SAMPLES or SAMPLES:SIZE, e.g. 256:512M, "
                                         f"got {text!r}")
    nbytes = _size(size) if size else MountConfig.lookahead_bytes
    if int(samples) and not nbytes:
        raise argparse.ArgumentTypeError(f"SIZE must be more than 0, got {text!r}")
    return int(samples), nbytes


def _add_pool_flags(p: argparse.ArgumentParser) -> None:
    """The chunk pool's flags, in a group of their own: none of them matters without
    --cache-dir."""
    g = p.add_argument_group(
        "chunk pool (cluster mode)",
        "With --cache-dir, each daemon stages its share of the chunks onto node-local\n"
        "storage in the background while reads are already served, and reads a chunk\n"
        "from local NVMe, else from the peer that owns it, else from the store.\n"
        "Every daemon of a job gets the same --nodes list and secret.")
    g.add_argument("--cache-dir", type=_path,
                   help="node-local directory (NVMe) for staged chunks; turns the chunk "
                        "pool on")
    g.add_argument("--nodes", action="append", metavar="NAME=HOST:PORT,...",
                   help="every daemon of the job (repeatable or comma-separated)")
    g.add_argument("--nodes-file", type=_path, help="file with one NAME=HOST:PORT per line")
    g.add_argument("--node", help="this daemon's NAME in the list (default: this host's "
                                  "short name)")
    g.add_argument("--replicas", type=_positive, default=1,
                   help="nodes that stage each chunk (default 1; 2 survives a lost node "
                        "without going to the store)")
    g.add_argument("--replica-wait", type=_replica_wait, metavar="SECONDS",
                   default=MountConfig.replica_wait,
                   help="with --replicas above 1, the first owner of a chunk copies it from "
                        "the store and the others copy it from that owner: each chunk "
                        "leaves the store once per job. The others wait at most SECONDS "
                        "without any chunk arriving from that owner, then copy from the "
                        "store (default %(default)g; 0: every owner copies from the store)")
    g.add_argument("--secret-file", type=_path,
                   help="per-job secret peers authenticate with; must be mode 0600 (required "
                        "with several nodes)")
    g.add_argument("--cache-limit", type=_size, help="stage at most this much, e.g. 500G "
                                                     "(default: no limit)")
    g.add_argument("--node-cache-limit", type=_size, metavar="SIZE",
                   help="the whole cache dir, all datasets, holds at most SIZE: datasets "
                        "earlier jobs left go first, least recently used first, never one "
                        "a running mount uses; checkpoint tiers (CACHE_DIR/ckpt/) count "
                        "but are never removed (default: no limit; Slurm: dlfs.conf "
                        "DLFS_CACHE_NODE_LIMIT)")
    g.add_argument("--passthrough", choices=("auto", "on", "off"), default="auto",
                   help="large files (a quarter chunk and 1 MiB or more) are copied whole into "
                        "--cache-dir, each extent checked as it is written, and the kernel "
                        "reads them from there itself (FUSE passthrough: a daemon running "
                        "as root, Linux >= 6.9); the daemon then answers every open, which "
                        "costs each small-file open a round trip: auto does it when large "
                        "files hold at least half of the mounted bytes, on whenever it can, "
                        "off never (default auto; `dlfs status` says which and why)")
    g.add_argument("--stage-jobs", type=_positive, default=2,
                   help="chunks copied from the store at once (default 2)")
    g.add_argument("--peer-timeout", type=_seconds, default=5.0,
                   help="seconds before a silent peer is skipped (default 5)")
    g.add_argument("--peer-procs", type=_peer_procs, metavar="N|auto", default=None,
                   help="processes serving this node's staged chunks to its peers, each "
                        "with a core's worth of Python (threads of one process would share "
                        "one); a process that dies is restarted (default auto: half the "
                        "cores this daemon may use, 1 to 8; 0 serves from loop threads of "
                        "the daemon's main process, the old way)")
    g.add_argument("--verify-served", action="store_true",
                   help="check each extent against its checksum the first time this node "
                        "serves it to a peer from its staged copy (a copy gone bad since "
                        "it was staged is re-staged before a peer sees it)")
    g.add_argument("--scrub-rate", type=_size, metavar="BYTES/S",
                   help="re-read the staged copies in the background at this rate, e.g. "
                        "64M, and re-stage any that went bad (default: off)")
    g.add_argument("--store-bandwidth", type=_size, help=argparse.SUPPRESS)  # benchmarks only
    g.add_argument("--slurm", action="store_true",
                   help="inside a Slurm job or prolog: --nodes and --node from the job's "
                        "environment; %%j (job id) and %%n (node) expand in the mountpoint, "
                        "--cache-dir, --secret-file, --log-file, --summary-file, --ckpt-store")
    g.add_argument("--mpi", action="store_true",
                   help="under mpirun/srun: one daemon per rank; the ranks exchange host "
                        "names and a fresh secret; %%n = host (HOST-RANK where ranks share "
                        "a host) in paths; all mounts come up or none")
    g.add_argument("--port-base", type=_port, default=7000,
                   help="with --slurm/--mpi: the first peer port (default 7000); with "
                        "--mpi node i listens on PORT_BASE + i")
    g.add_argument("--port-span", type=_positive, default=1, metavar="N",
                   help="with --slurm: N ports from PORT_BASE are DLFS's, and each job "
                        "takes its own by job id (job id mod N), so several jobs can "
                        "share a node; a node whose port is taken listens on the job's "
                        "next one, where its peers look next (default 1: every job on "
                        "PORT_BASE, no fallback; the shipped dlfs.conf sets 10000; "
                        "deploy/slurm/README.md)")
    g.add_argument("--node-host", default="%n", metavar="PATTERN",
                   help="with --slurm/--mpi: address of each node, %%n = its host name "
                        "(default %%n; 127.0.0.1 for simulated nodes on one host)")


def _peer_procs(text: str) -> int | None:
    """`--peer-procs`: a count (0 or more) or `auto` (None)."""
    return None if text == "auto" else _non_negative(text)


def cmd_mount(args: argparse.Namespace) -> int:
    """Start the daemon (or become it, --foreground) and return once the mount
    answers; --mpi and --slurm first fill the cluster flags in."""
    from dlfs.cli.mountctl import daemon_log_path, mount

    if args.mpi:
        return _mount_mpi(args)
    if args.slurm:
        apply_slurm(args, dict(os.environ))
    config = _mount_config(args)
    code = mount(config, foreground=args.foreground, timeout=args.timeout)
    if not args.foreground:
        print(f"mounted {config.store} at {mountpoint_path(config.mountpoint)}; daemon log: "
              f"{daemon_log_path(config)}")
    return code


def apply_slurm(args: argparse.Namespace, env: dict[str, str]) -> None:
    """`mount --slurm`: fill the cluster flags from the job's environment (dlfs.cluster.slurm):
    every node of the job with its port, this node's name, and %j/%n expanded in the
    paths. Without --cache-dir there is no pool, so only the paths change."""
    from dlfs.cluster.slurm import expand_pattern, job_from_env, peer_nodes

    if args.nodes or args.nodes_file or args.node:
        raise UsageError("--slurm takes the nodes from the job; drop --nodes, --nodes-file "
                         "and --node")
    job = job_from_env(env)
    for flag in ("mountpoint", "log_file", "cache_dir", "secret_file", "summary_file",
                 "ckpt_store"):
        value = getattr(args, flag)
        if value:
            setattr(args, flag, expand_pattern(value, job.job_id, job.node))
    if args.cache_dir:
        peers = peer_nodes(job, args.port_base, args.node_host, args.port_span)
        args.nodes = [",".join(peer.spec() for peer in peers)]
        args.node = job.node


def _cluster_settings(args: argparse.Namespace) -> dict:
    """The chunk-pool flags of `mount`, validated here so mistakes fail before any daemon starts."""
    from dlfs.cluster.nodes import resolve_cluster

    nodes = node_items(args)
    wants_pool = bool(nodes or args.node or args.secret_file or args.cache_limit
                      or args.node_cache_limit or args.verify_served or args.scrub_rate
                      or args.peer_procs is not None)
    if wants_pool and not args.cache_dir:
        raise UsageError("--nodes, --node, --secret-file, --cache-limit, --node-cache-limit, "
                         "--verify-served, --scrub-rate and --peer-procs need --cache-dir "
                         "(the node-local directory chunks are staged into)")
    if not args.cache_dir:
        return {}
    view = resolve_cluster(tuple(nodes), args.node, args.replicas, args.secret_file)
    return dict(cache_dir=os.path.abspath(args.cache_dir), nodes=tuple(str(n) for n in view.nodes)
                if nodes else (), node=view.me.name if nodes else args.node,
                replicas=args.replicas, replica_wait=args.replica_wait,
                secret_file=os.path.abspath(args.secret_file) if args.secret_file else None,
                cache_limit=args.cache_limit or 0, stage_jobs=args.stage_jobs,
                node_cache_limit=args.node_cache_limit or 0,
                peer_timeout=args.peer_timeout, verify_served=args.verify_served,
                peer_procs=args.peer_procs,
                scrub_rate=args.scrub_rate or 0)


def _mount_config(args: argparse.Namespace) -> MountConfig:
    for flag, path in (("--log-file", args.log_file), ("--summary-file", args.summary_file)):
        _check_file_target(flag, path)
    for flag, value in (("--io-threads", args.io_threads), ("--max-tasks", args.max_tasks)):
        if value is not None:
            print(f"dlfs: warning: {flag} has no effect any more (it tuned the single-process "
                  "mode, which is gone: worker processes serve one request each); drop it",
                  file=sys.stderr)
    return MountConfig(
        **_cluster_settings(args), **_ckpt_settings(args),
        mountpoint=args.mountpoint, store=os.path.abspath(args.store),
        datasets=tuple(args.dataset or ()), verify=not args.no_verify,
        workers=args.workers,
        cache_timeout=args.cache_timeout, read_ahead_kb=args.read_ahead_kb,
        allow_other=args.allow_other, uid=args.uid, gid=args.gid, debug=args.debug,
        log_file=os.path.abspath(args.log_file) if args.log_file else None,
        stats=not args.no_stats, count_opens=args.count_opens, prefetch=args.prefetch,
        splice=not args.no_splice, store_bandwidth=args.store_bandwidth or 0,
        trace_capacity=args.trace_capacity, lookahead=bool(args.lookahead[0]),
        lookahead_samples=args.lookahead[0] or MountConfig.lookahead_samples,
        lookahead_bytes=args.lookahead[1], lookahead_streams=args.lookahead_streams,
        lookahead_stale=args.lookahead_stale,
        lookahead_pipeline=args.lookahead_pipeline, lookahead_peers=args.lookahead_peers,
        stall_seconds=args.stall_seconds,
        request_timeout=args.request_timeout, passthrough=args.passthrough,
        summary_file=os.path.abspath(args.summary_file) if args.summary_file else None)


def _ckpt_settings(args: argparse.Namespace) -> dict:
    """The checkpoint flags, checked before any daemon starts."""
    if not args.ckpt_store:
        if args.drain_bandwidth or args.ckpt_limit:
            raise UsageError("--drain-bandwidth and --ckpt-limit need --ckpt-store")
        return {}
    if not args.cache_dir:
        raise UsageError("--ckpt-store needs --cache-dir (the node-local directory "
                         "checkpoints are written to before they drain)")
    store = os.path.abspath(args.ckpt_store)
    if os.geteuid() == 0 and args.uid not in (None, 0):
        # Root mounting for a job's user never makes the store's directories itself: a
        # path the user may shape (a symlink planted in a parent it owns) would have
        # root create directories anywhere. The daemon reaches it as the user.
        if not os.path.isdir(store):
            raise DlfsError(f"--ckpt-store {store} is not a directory: a root mount for "
                            f"uid {args.uid} does not create it; make it the user's first "
                            "(the Slurm prolog runs `dlfs slurm-ckpt-dir`)")
        return _ckpt_flags(args, store)
    try:
        os.makedirs(store, exist_ok=True)
    except OSError as err:
        raise DlfsError(f"--ckpt-store {store}: cannot create it ({err.strerror}); give a "
                        "directory on the store's file system") from None
    if not os.path.isdir(store):
        raise DlfsError(f"--ckpt-store {store} is not a directory")
    return _ckpt_flags(args, store)


def _ckpt_flags(args: argparse.Namespace, store: str) -> dict:
    return dict(ckpt_store=store, drain_bandwidth=args.drain_bandwidth or 0,
                drain_jobs=args.drain_jobs, ckpt_limit=args.ckpt_limit or 0,
                ckpt_keep=args.ckpt_keep, ckpt_limit_wait=args.ckpt_limit_wait)


def _check_file_target(flag: str, path: str | None) -> None:
    """A file the daemon will write (its log now, a summary at unmount): fail the mount
    now, in one line, rather than lose what the daemon cannot write later."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DlfsError(f"{flag} {path}: directory {parent} does not exist (create it, or "
                        f"give another path)")
    if os.path.isdir(path):
        raise DlfsError(f"{flag} {path} is a directory; give a file path")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise DlfsError(f"{flag} {path}: not writable (check permissions, or give another "
                        "path)")


def _mount_mpi(args: argparse.Namespace) -> int:
    """One mount per MPI rank with a shared node list and secret; all come up or none.

    Each daemon keeps its mount only once every rank is up (mount_uncommitted): a rank
    interrupted or killed meanwhile (Ctrl-C on mpirun, which then kills the ranks
    waiting for it) leaves no daemon running and nothing mounted."""
    from dlfs.cli.mountctl import commit_mount, daemon_log_path, mount_uncommitted, umount
    from dlfs.cluster.mpi_launch import (
        all_or_nothing,
        apply_mpi,
        check_mpi_flags,
        default_secret_file,
        join_world,
        share_secret,
    )

    check_mpi_flags(args)
    world = join_world()
    secret = share_secret(world)
    pending: list[tuple[MountConfig, int]] = []  # (its mount, commit descriptor)
    committed = False

    def step() -> None:
        apply_mpi(args, world, secret)
        config = _mount_config(args)
        pending.append((config, mount_uncommitted(config, args.timeout)))

    def undo() -> None:
        for config, _ in pending:
            umount(config.mountpoint, timeout=10)

    try:
        all_or_nothing(world, step, undo)
        while pending:
            config, fd = pending.pop()
            committed = True  # from here on its daemon keeps the mount, and the secret
            commit_mount(fd, config)
            print(f"mounted {config.store} at {mountpoint_path(config.mountpoint)} on "
                  f"{world.name}; daemon log: {daemon_log_path(config)}", flush=True)
        return EXIT_OK
    except ReportedElsewhere:
        return EXIT_ERROR  # rank 0 prints the one line
    finally:
        for _, fd in pending:  # not committed: each daemon unmounts itself
            os.close(fd)
        if not committed and args.secret_file == default_secret_file(world, args.mountpoint):
            with contextlib.suppress(OSError):
                os.unlink(args.secret_file)


def _add_placement(subs: Subparsers) -> None:
    p = add_command(
        subs, "placement", cmd_placement,
        "show how many chunks and bytes of a dataset each node of a job would own",
        "examples:\n  dlfs placement --store /lustre/store imagenet --nodes "
        "n1=10.0.0.1:7100,n2=10.0.0.2:7100\n"
        "  dlfs placement --store /lustre/store imagenet --nodes-file nodes.txt "
        "--replicas 2")
    p.add_argument("--store", type=_path, required=True)
    p.add_argument("name")
    p.add_argument("--nodes", action="append", metavar="NAME=HOST:PORT,...")
    p.add_argument("--nodes-file", type=_path)
    p.add_argument("--replicas", type=_positive, default=1)


def cmd_placement(args: argparse.Namespace) -> int:
    """Preview a pool: the same rendezvous table every daemon computes, so the
    balance across nodes is seen before anything is mounted."""
    from dlfs.cluster.nodes import parse_nodes
    from dlfs.cluster.placement import owners, summary

    items = node_items(args)
    nodes = parse_nodes(items) if items else []
    if not nodes:
        raise UsageError("give the job's nodes with --nodes or --nodes-file")
    if not 1 <= args.replicas <= len(nodes):
        raise UsageError(f"--replicas must be between 1 and {len(nodes)} (the nodes listed)")
    d = Store(args.store).open(args.name)
    table = owners(d.uuid, d.chunk_count, [n.name for n in nodes], args.replicas)
    rows = [("NODE", "PRIMARY", "CHUNKS", "BYTES", "SHARE")]
    total = int(d.chunk_lengths.sum()) or 1
    for node, (primary, held, nbytes) in zip(nodes, summary(table, d.chunk_lengths, len(nodes)),
                                             strict=True):
        rows.append((node.name, str(primary), str(held), format_size(nbytes),
                     f"{100 * nbytes / total:.1f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"{d.name}: {d.chunk_count} chunks, {format_size(total)}, {len(nodes)} nodes, "
          f"{args.replicas} replica(s) per chunk")
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return EXIT_OK


def _add_status(subs: Subparsers) -> None:
    p = add_command(
        subs, "status", cmd_status,
        "show a mount's staging progress and where its reads were served from",
        "examples:\n  dlfs status /mnt/dlfs\n  dlfs status /mnt/dlfs --watch\n"
        "  dlfs status /mnt/dlfs --json")
    p.add_argument("mountpoint", type=_path)
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--interval", type=_seconds, default=1.0, help="seconds between refreshes")


def cmd_status(args: argparse.Namespace) -> int:
    """Thin: dlfs.obs.statusview renders the status file the daemon rewrites."""
    from dlfs.obs.statusview import show_status

    return show_status(args.mountpoint, watch=args.watch, as_json=args.json,
                       interval=args.interval)


def _add_umount(subs: Subparsers) -> None:
    p = add_command(
        subs, "umount", cmd_umount,
        "unmount and wait for the daemon to exit (also cleans a dead daemon's mount)",
        "examples:\n  dlfs umount /mnt/dlfs\n  dlfs umount --lazy /mnt/dlfs")
    p.add_argument("mountpoint", type=_path)
    p.add_argument("--lazy", action="store_true", help="detach now even if files are open")
    p.add_argument("--mpi", action="store_true",
                   help="unmount on every MPI rank (after `mount --mpi`; %%n as there)")
    p.add_argument("--timeout", type=_seconds, default=30.0,
                   help="seconds to wait for the daemon to exit before killing it")


def cmd_umount(args: argparse.Namespace) -> int:
    """Unmount and wait for the daemon to exit. With --mpi every rank does its
    own, and a rank with nothing mounted (a half-up launch) is no error."""
    from dlfs.cli.mountctl import umount

    if not args.mpi:
        return umount(args.mountpoint, lazy=args.lazy, timeout=args.timeout)
    from dlfs.cluster.mpi_launch import all_or_nothing, default_secret_file, expand_node, join_world

    world = join_world()

    def step() -> None:
        mountpoint = expand_node(world, args.mountpoint)
        # Not mounted: a half-up launch, or a rank whose daemon went; nothing to do here.
        with contextlib.suppress(NotMountedError):
            umount(mountpoint, lazy=args.lazy, timeout=args.timeout)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(default_secret_file(world, mountpoint))

    try:
        return all_or_nothing(world, step, lambda: None)
    except ReportedElsewhere:
        return EXIT_ERROR


def _add_stop_daemon(subs: Subparsers) -> None:
    p = add_command(
        subs, "stop-daemon", cmd_stop_daemon,
        "stop what is left of a mount's daemon, found by its runtime record (epilog)",
        "example (in the Slurm epilog, as root, after `dlfs umount`):\n"
        "  dlfs stop-daemon /mnt/dlfs/1234\n"
        "\nThe daemon is the pid its runtime record names (root's /run/dlfs for a root\n"
        "mount), checked to be ours and its own session's leader; its processes are that\n"
        "session's (a dead daemon's workers too), never any process whose command line\n"
        "merely looks like a daemon's. TERM, then KILL after --timeout; exit 1 if one\n"
        "survives. The mount itself is `dlfs umount`'s.")
    p.add_argument("mountpoint", type=_path)
    p.add_argument("--timeout", type=_seconds, default=5.0,
                   help="seconds between SIGTERM and SIGKILL (default 5)")


def cmd_stop_daemon(args: argparse.Namespace) -> int:
    """Thin: dlfs.cli.mountctl.stop_daemon."""
    from dlfs.cli.mountctl import stop_daemon

    path = mountpoint_path(args.mountpoint)
    stopped = stop_daemon(path, args.timeout)
    print(f"stopped the daemon of {path}: pids {' '.join(map(str, stopped))}" if stopped
          else f"no daemon of {path} left")
    return EXIT_OK

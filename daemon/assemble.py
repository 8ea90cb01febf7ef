"""Assembly: each part of the daemon built from its own settings, before and after the mount.

MountConfig is read here (besides dlfsd.main, which only orders the steps, and
the small XConfig.from_mount of a part that takes a config object:
dlfsd.obs.observe, dlfsd.obs.status, dlfsd.ckptconnect), never by the parts
themselves: each gets constructor arguments, whole, and none is patched after
it is made. What the workers share (the namespace's
counters and flags, the pool's tables and demand pipe, the checkpoint tier,
the look-ahead's flag) is made by assemble(), before they fork; what only the
main process runs is made once all of its parts exist (build_services).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dlfs.cluster.nodes import ClusterView, Node, node_addresses, resolve_cluster
from dlfs.config import MountConfig
from dlfs.errors import DlfsError
from dlfs.mountinfo import find_mount
from dlfs.pipes import describe_pipe_size, usable_pipe_size
from dlfs.runtime import control_socket_path, open_log_file
from dlfs.sizes import format_size
from dlfs.store import nodecache
from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfs.store.store import Dataset, Store
from dlfsd.base.access import admits_others, served_to_user, shown_owner
from dlfsd.base.kernel import kernel_release, kernel_skips_opens
from dlfsd.ckptconnect import CkptConfig, CkptConnection, CkptTier, open_tier
from dlfsd.core.lookahead import LookAhead
from dlfsd.core.namespace import PRIVATE_ROOT_MODE, ROOT_MODE, Namespace
from dlfsd.core.ordersock import OrderService
from dlfsd.core.passthrough import MountPassthrough, planned_copy_bytes
from dlfsd.core.prefetch import available_memory, prefetch_decision
from dlfsd.fuse.wireworker import WireWorker, find_fuse_fd, fuse_fds
from dlfsd.obs.controlsock import ControlServer
from dlfsd.obs.health import HealthWatch
from dlfsd.obs.observe import ObserveConfig
from dlfsd.obs.status import StatusConfig
from dlfsd.services import PICK_ANOTHER_PORT, PoolServices, Services
from dlfsd.supervise import fork_workers

if TYPE_CHECKING:
    from dlfsd.pool.pool import ChunkPool

log = logging.getLogger("dlfsd")


def configure_logging(config: MountConfig) -> None:
    """One handler for the whole process (the daemon's log file, else stderr), set
    before anything logs: a background daemon's stdio already goes to that file,
    and checksum errors and the like must be found in one place."""
    handler: logging.Handler
    if config.log_file:
        os.close(open_log_file(config.log_file))  # made 0640 (a foreground mount's too)
        handler = logging.FileHandler(config.log_file, errors="backslashreplace")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if config.debug else logging.INFO)


def mount_options(config: MountConfig) -> set[str]:
    """The datasets' connection's kernel mount options (libfuse's -o)."""
    options = {"fsname=dlfs", "subtype=dlfs", "default_permissions", "noatime"}
    if not config.ckpt_store:  # with a checkpoint tier the core refuses writes (EROFS)
        options.add("ro")
    if admits_others(config.allow_other, config.uid):
        options.add("allow_other")
    if config.debug:
        options.add("debug")
    return options


@dataclass
class Daemon:
    """What is ready before the mount: the namespace and what serves it."""

    namespace: Namespace
    pool: ChunkPool | None
    staging: PoolServices | None  # the pool's stager, peer server, replication, scrub
    fds_before_mount: set[int]  # /dev/fuse descriptors open before ours
    order: OrderService | None  # samplers' announcements -> the look-ahead
    ckpt: CkptTier | None = None  # the checkpoint tier (--ckpt-store)
    # large files by FUSE passthrough (dlfsd.core.passthrough): decided here, settled at INIT
    passthrough: MountPassthrough = field(
        default_factory=lambda: MountPassthrough(False, "off"))


def assemble(config: MountConfig, release: contextlib.ExitStack) -> Daemon:
    """Datasets, chunk pool, namespace and what serves them, before mounting; made
    before the workers fork, which share what they hold in shared memory."""
    datasets = load_datasets(config)
    pool, cache_limit = load_pool(config, datasets)
    if pool is not None:
        release.callback(pool.close)
    prefetch, why = prefetch_decision(
        config.prefetch, pool is not None, bool(config.store_bandwidth),
        sum(int(d.stats["bytes"]) for d in datasets), available_memory())
    log.info("chunk prefetch %s", why)
    namespace = Namespace(datasets, verify=config.verify, observe=ObserveConfig.from_mount(config),
                          pool=pool, store_rate=config.store_bandwidth,
                          root_mode=ROOT_MODE if config.uid is None else PRIVATE_ROOT_MODE,
                          prefetch=prefetch)
    release.callback(namespace.close)
    # Chunk files (twice with a pool: the store's and the staged copy), and with peers
    # the server's connections (main process) or a connection to each peer (a worker).
    peer_fds = 0
    if pool is not None:
        from dlfsd.pool.peerserver import connection_slots

        peer_fds = connection_slots(len(pool.view.nodes), config.workers)
    raise_fd_limit(sum(d.chunk_count for d in datasets) * (2 if pool is not None else 1)
                   + peer_fds)
    staging = (pool_services(config, pool, namespace.datasets, cache_limit)
               if pool is not None else None)
    passthrough = MountPassthrough.prepare(config.passthrough, pool, namespace,
                                           staging.stager if staging is not None else None,
                                           config.store_bandwidth)
    release.callback(passthrough.close)
    ckpt = _ckpt_tier(config, namespace, release)
    order = _order_service(config, namespace, pool)
    if order is not None:
        release.callback(order.lookahead.close)
    return Daemon(namespace, pool, staging, fuse_fds(), order, ckpt, passthrough)


def load_datasets(config: MountConfig) -> list[Dataset]:
    """The datasets to serve, opened and sorted by name (the order inodes and the
    pool's tables follow); a store with none fails the mount in one line."""
    store = Store(config.store).require()
    names = list(config.datasets) or store.dataset_names()
    if not names:
        raise DlfsError(f"store {config.store} has no datasets (populate one with `dlfs populate`)")
    # A root daemon mounting for a user serves only what that user may read.
    names = served_to_user(names, store.path, config.uid, config.gid, bool(config.datasets))
    return sorted((store.open(name) for name in names), key=lambda d: d.name)


def load_pool(config: MountConfig, datasets: list[Dataset]) -> tuple[ChunkPool | None, int]:
    """The chunk pool of a cluster-mode mount (None without --cache-dir), and how many
    bytes it may stage (limit_for_node; 0: no limit)."""
    if not config.pooled:
        return None, 0
    from dlfsd.pool.pool import ChunkPool  # cluster mode only

    seen: dict[bytes, str] = {}
    for d in datasets:  # the pool keys staged copies and peer requests by dataset uuid
        if d.uuid in seen:
            raise DlfsError(f"datasets {seen[d.uuid]} and {d.name} are copies of one dataset "
                            "(same uuid, a directory copied within the store): a chunk pool "
                            "can serve one of them; mount it alone with --dataset, or "
                            "populate the copy afresh")
        seen[d.uuid] = d.name

    view = resolve_cluster(config.nodes, config.node, config.replicas, config.secret_file)
    if len(view.nodes) > 1:
        view = take_free_port(view)
    cache_root = Path(config.cache_dir)
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DlfsError(f"cannot create cache dir {cache_root}: {err.strerror}") from None
    # Rows of the shared fetch counters: the main process, the workers, the control process.
    pool = ChunkPool(view, datasets, cache_root, config.peer_timeout,
                     processes=config.workers + 2,
                     ahead=(config.lookahead_samples, config.lookahead_bytes)
                     if config.lookahead else (0, 0))
    cache_limit = limit_for_node(config, pool)
    adopted = pool.scan_caches(cache_limit)
    log.info("chunk pool: node %s of %d, %d replicas, peer port %s:%d, cache %s (%d staged "
             "chunks reused)", view.me.name, len(view.nodes), view.replicas, view.me.host,
             view.me.port, cache_root, adopted)
    dirs, nbytes = pool.foreign_copies()
    if dirs:
        log.warning("cache dir %s also holds %s in %d dataset directories this mount does "
                    "not use (re-populated or removed datasets, or another mount's); they "
                    "count against no --cache-limit: delete those no mount uses", cache_root,
                    format_size(nbytes), dirs)
    return pool, cache_limit


def limit_for_node(config: MountConfig, pool) -> int:
    """This mount's --cache-limit under the node-wide --node-cache-limit: datasets earlier
    jobs left are removed, least recently used first, until this mount's share fits
    beside what stays (never one a running mount uses, never a checkpoint tier, whose
    bytes count all the same: dlfs.store.nodecache); the mount then stages at most
    what is left. 0: no limit."""
    if not config.node_cache_limit:
        return config.cache_limit
    ours = {cache.dir.name for cache in pool.caches}
    others = [d for d in nodecache.datasets(Path(config.cache_dir)) if d.uuid not in ours]
    share = sum(int(d.chunk_lengths[owned].sum()) + CHUNK_HEADER_SIZE * int(owned.sum())
                for d, owned in zip(pool.datasets, pool.owned, strict=True))  # on disk
    share += planned_copy_bytes(config.passthrough, pool.datasets, pool.owned)
    want = min(share, config.cache_limit or share, config.node_cache_limit)
    tiers = nodecache.ckpt_bytes(Path(config.cache_dir))
    if tiers:
        log.info("node cache limit %s: checkpoint tiers in %s/ckpt hold %s (counted, never "
                 "removed)", format_size(config.node_cache_limit), config.cache_dir,
                 format_size(tiers))
    budget = max(config.node_cache_limit - want - tiers, 0)
    for victim in nodecache.select_for_pruning(others, to_size=budget):
        if nodecache.remove(victim):
            log.info("node cache limit: removed dataset %s (%s, last used %s) from %s",
                     victim.uuid, format_size(victim.bytes), time.ctime(victim.last_used),
                     config.cache_dir)
    left = sum(d.bytes for d in nodecache.datasets(Path(config.cache_dir))
               if d.uuid not in ours) + tiers
    room = max(config.node_cache_limit - left, 1)
    if room < want:
        log.warning("node cache limit %s: %s held by datasets other mounts use or that "
                    "could not be removed, and by checkpoint tiers; this mount stages at "
                    "most %s of its %s share",
                    format_size(config.node_cache_limit), format_size(left),
                    format_size(room), format_size(share))
    return min(config.cache_limit, room) if config.cache_limit else room


def check_port_free(host: str, port: int) -> None:
    """Fail the mount now, with a clear line, if the peer port is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise DlfsError(f"cannot listen for peers on {host}:{port}: {err.strerror}; "
                            f"{PICK_ANOTHER_PORT}") from None


def take_free_port(view: ClusterView) -> ClusterView:
    """The view with this node on the first of its ports that is free (its peers try
    them in the same order: dlfs.cluster.nodes.Node.alt_ports); the ones after it stay
    as fallbacks for listen(). DlfsError naming every port if none is free."""
    me = view.me
    errors = []
    for index, port in enumerate(me.ports):
        try:
            check_port_free(me.host, port)
        except DlfsError as err:
            errors.append(str(err).split(";")[0])
            continue
        if index:
            log.warning("peer port %s:%d is taken (%s); listening on the job's next port "
                        "%d, where the other nodes look next", me.host, me.port,
                        "; ".join(errors), port)
        chosen = Node(me.name, me.host, port, me.ports[index + 1:])
        nodes = tuple(chosen if i == view.self_index else n for i, n in enumerate(view.nodes))
        return replace(view, nodes=nodes)
    ports = ", ".join(map(str, me.ports))
    raise DlfsError(f"cannot listen for peers on {me.host}: ports {ports} are all taken "
                    f"({'; '.join(errors)}); {PICK_ANOTHER_PORT}")


FD_MARGIN = 1024  # descriptors a process needs besides chunk files (sockets, pipes, logs)


def raise_fd_limit(chunk_files: int) -> int:
    """Each process keeps every chunk file it reads open (twice with a chunk pool: the
    store's and the staged copy): raise the open-file limit to what that needs, as far
    as we may (the hard limit; beyond it with CAP_SYS_RESOURCE, as root on a node), and
    say so once at mount if it is still short. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = chunk_files + FD_MARGIN
    for limit in (max(want, hard), hard):
        if limit <= soft:
            break
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, max(limit, hard)))
            soft = limit
            break
    if soft < want:
        log.warning("open-file limit %d is below the %d this mount may keep open (%d chunk "
                    "files + %d): once a worker has that many open it closes them all and "
                    "starts over; raise the limit (ulimit -n, LimitNOFILE=, or mount as "
                    "root)", soft, want, chunk_files, FD_MARGIN)
    return soft


def pool_services(config: MountConfig, pool: ChunkPool, datasets: list[Dataset],
                  cache_limit: int) -> PoolServices:
    """The stager (at most `cache_limit` bytes staged, 0: no limit) and, as the job
    asks for them, replication from primaries, the peer server and the scrub."""
    from dlfsd.pool.stager import Stager

    view = pool.view
    replicas = None
    if len(view.nodes) > 1 and view.replicas > 1 and config.replica_wait:
        from dlfsd.pool.replicate import ReplicaSource

        replicas = ReplicaSource(view, datasets, pool.tables, config.peer_timeout,
                                 config.replica_wait)
    stager = Stager(datasets, pool.caches, pool.owned, pool.demand, jobs=config.stage_jobs,
                    cache_limit=cache_limit, store_rate=config.store_bandwidth,
                    replicas=replicas)
    pool.set_stager(stager.will_stage)
    server = None
    if len(view.nodes) > 1:
        from dlfsd.pool.peerprocs import PeerServers, peer_processes
        from dlfsd.pool.peerserver import connection_slots, serve_threads

        server = PeerServers(view.secret, pool, view.me.name,
                             processes=peer_processes(config.peer_procs),
                             max_connections=connection_slots(len(view.nodes), config.workers),
                             trusted=node_addresses(view.nodes),
                             verify_served=config.verify_served, threads=serve_threads())
    scrubber = None
    if config.scrub_rate:
        from dlfsd.pool.scrub import Scrubber

        scrubber = Scrubber(pool, config.scrub_rate)
    return PoolServices(pool, stager, replicas, server, scrubber)


def _ckpt_tier(config: MountConfig, namespace: Namespace,
               release: contextlib.ExitStack) -> CkptTier | None:
    """The checkpoint tier (None without --ckpt-store), shown as `ckpt/` in the root."""
    ckpt_config = CkptConfig.from_mount(config)
    if ckpt_config is None:
        return None
    return open_tier(ckpt_config, namespace, release)


def _order_service(config: MountConfig, namespace: Namespace, pool) -> OrderService | None:
    """The look-ahead and its socket, made before the workers fork (they share its flag)."""
    if not config.lookahead:
        return None
    lookahead = LookAhead(namespace, pool, config.lookahead_samples, config.lookahead_bytes,
                          config.lookahead_streams, config.store_bandwidth,
                          config.lookahead_stale, config.lookahead_pipeline,
                          config.lookahead_peers)
    namespace.observe.add_section("lookahead", lookahead.counter_dict)
    return OrderService(config.mountpoint, lookahead, config.uid)


def start_workers(config: MountConfig, daemon: Daemon) -> dict[int, int]:
    """Fork config.workers processes (at least one) serving the same FUSE session;
    returns pid -> the session's /dev/fuse descriptor (what watch_workers wants).

    The kernel hands each request to exactly one reader of /dev/fuse, so N
    processes serve N requests at once on N cores. A blocked read() of
    /dev/fuse must never strand an unfinished request, so every process
    handles one request at a time with blocking I/O (the libfuse multi-thread
    model); data is immutable and handles are stateless, so no state needs
    sharing. Workers speak the kernel protocol themselves
    (dlfsd.fuse.wireworker: pyfuse3's per-request cost is most of a small
    file's). The main process only supervises and runs the services (see
    supervise). There is no single-process mode: pyfuse3 serving requests in
    the main process's trio loop reached 0.07-0.41 of the source's rate in
    bench/random_read.py where the workers reach 0.6-0.9 (docs/ARCHITECTURE.md).
    """
    namespace, pool = daemon.namespace, daemon.pool
    uid, gid = shown_owner(config.uid, config.gid)
    fuse_fd = find_fuse_fd(daemon.fds_before_mount)
    pipe_size = usable_pipe_size() if config.splice else 0
    if config.splice:
        log.info(describe_pipe_size(pipe_size))
    no_open, no_opendir = kernel_skips_opens()
    if not (no_open and no_opendir):
        log.info("kernel %s: the workers answer %s (this kernel would pass on the ENOSYS "
                 "that tells newer ones to stop asking)", kernel_release(),
                 "OPENDIR" if no_open else "OPEN and OPENDIR")

    def serve() -> int:
        if pool is not None:
            pool.after_fork()
        return WireWorker(namespace, fuse_fd, uid, gid, config.cache_timeout,
                          config.count_opens, pipe_size, daemon.passthrough.opens).serve()

    return {pid: fuse_fd for pid in fork_workers(config.workers, serve, config.mountpoint)}


def build_services(config: MountConfig, daemon: Daemon, ckpt: CkptConnection | None,
                   fuse: dict) -> Services:
    """The main process's services, once the checkpoint connection (if any) is up;
    `fuse`: what the datasets' INIT granted, for the status file."""
    observe = daemon.namespace.observe
    stager = daemon.staging.stager if daemon.staging is not None else None
    health = HealthWatch(observe.requests, config.stall_seconds, observe.path_of,
                         observe.health, observe.peer_marks, daemon.pool, stager)
    return Services(StatusConfig.from_mount(config), daemon.namespace.datasets, observe.stats,
                    health, daemon.staging, ckpt, fuse, daemon.passthrough.report)


def control_server(config: MountConfig, daemon: Daemon) -> ControlServer:
    """The socket of `dlfs trace` and `dlfs flush` (started after the workers fork)."""
    return ControlServer(str(control_socket_path(config.mountpoint)), daemon.namespace.observe,
                         (daemon.order,) if daemon.order is not None else (),
                         ckpt=daemon.ckpt.control if daemon.ckpt is not None else None,
                         ckpt_uid=config.uid)


def set_read_ahead(mountpoint: str, kb: int) -> None:
    """Raise the kernel read-ahead of our mount (FUSE starts at 128 KiB).

    Sequential reads of large files then reach the daemon as fewer, larger
    requests. Needs root; elsewhere the kernel default stays.
    """
    entry = find_mount(mountpoint)
    if entry is None or kb <= 0:
        return
    try:
        with open(f"/sys/class/bdi/{entry.device}/read_ahead_kb", "w") as f:
            f.write(str(kb))
    except OSError as err:
        log.info("kept the default read-ahead (cannot set it to %d KiB: %s)", kb, err.strerror)

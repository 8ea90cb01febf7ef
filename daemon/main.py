"""The daemon's lifecycle: load datasets, mount, serve until unmounted or signalled.

Started by `dlfs mount` (in-process with --foreground, or as
`python -m dlfsd --config JSON` in its own session). It reports readiness
through the file descriptor in $DLFS_READY_FD: "READY" once the kernel mount
exists, or "ERROR <one line>" if it cannot come up.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from dlfs.cluster.nodes import ClusterView, Node, node_addresses, resolve_cluster
from dlfs.config import MountConfig
from dlfs.errors import DlfsError
from dlfs.launch import (
    CONFIG_FLAG,
    ERROR_PREFIX,
    READY,
    READY_FD_ENV,
    VERSION_FLAG,
    version_refusal,
)
from dlfs.mountinfo import find_mount
from dlfs.pipes import describe_pipe_size, usable_pipe_size
from dlfs.runtime import (
    DaemonRecord,
    control_socket_path,
    open_log_file,
    remove_record,
    start_time,
    status_path,
    write_record,
)
from dlfs.sizes import format_size
from dlfs.store import nodecache
from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfs.store.store import Dataset, Store
from dlfsd import __version__
from dlfsd.access import admits_others, served_to_user, shown_owner
from dlfsd.ckpt.connect import CkptConfig, CkptConnection, CkptTier, connect, open_tier
from dlfsd.commit import LaunchCommit, LaunchSecret
from dlfsd.fuse import session
from dlfsd.fuse.wireworker import WireWorker, find_fuse_fd, fuse_fds
from dlfsd.kernel import INIT_TIMEOUT, kernel_release, kernel_skips_opens
from dlfsd.lookahead import LookAhead
from dlfsd.namespace import PRIVATE_ROOT_MODE, ROOT_MODE, Namespace
from dlfsd.obs.controlsock import ControlServer
from dlfsd.obs.health import HealthWatch
from dlfsd.obs.observe import ObserveConfig
from dlfsd.obs.status import StatusConfig, write_status
from dlfsd.ordersock import OrderService
from dlfsd.prefetch import available_memory, prefetch_decision
from dlfsd.services import PICK_ANOTHER_PORT, PoolServices, Services
from dlfsd.supervise import (
    HeldStopSignals,
    Teardown,
    fork_workers,
    still_mounted,
    stop_workers,
    supervise,
    unmount_dead,
)

if TYPE_CHECKING:
    from dlfsd.pool.pool import ChunkPool

log = logging.getLogger("dlfsd")


def mount_options(config: MountConfig) -> set[str]:
    options = {"fsname=dlfs", "subtype=dlfs", "default_permissions", "noatime"}
    if not config.ckpt_store:  # with a checkpoint tier the core refuses writes (EROFS)
        options.add("ro")
    if admits_others(config.allow_other, config.uid):
        options.add("allow_other")
    if config.debug:
        options.add("debug")
    return options


def configure_logging(config: MountConfig) -> None:
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
    if not config.debug:
        logging.getLogger("pyfuse3").setLevel(logging.WARNING)


def load_datasets(config: MountConfig) -> list[Dataset]:
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


class Readiness:
    """Tells the starting `dlfs mount` whether we came up (once)."""

    def __init__(self) -> None:
        fd = os.environ.pop(READY_FD_ENV, None)
        self.fd = int(fd) if fd else None
        # Forked workers and the control process must not hold the pipe: if this
        # process died before READY, `dlfs mount` would see no end of file and wait
        # its whole timeout.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def send(self, message: str) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, (message.replace("\n", " ") + "\n").encode(errors="backslashreplace"))
            os.close(self.fd)
        except OSError:
            pass
        self.fd = None


def run(config: MountConfig, readiness: Readiness | None = None) -> int:
    """Mount and serve; returns the process exit code.

    Every resource is released by one ExitStack, in the reverse order it was
    taken, whichever step fails: the order lives where each is acquired.
    """
    readiness = readiness or Readiness()
    commit = LaunchCommit.from_env(LaunchSecret(config.secret_file, config.node,
                                                config.mountpoint))
    configure_logging(config)
    with contextlib.ExitStack() as release:
        try:
            daemon = assemble(config, release)
        except DlfsError as err:
            log.error("%s", err)
            readiness.send(f"{ERROR_PREFIX}{err}")
            return err.exit_code
        except Exception as err:
            return _mount_failed(config, readiness, err)
        # From the mount on, a stop signal must end in the unmount below, never cut in
        # between (a Ctrl-C on `dlfs mount --foreground` right after the mount used to
        # leave a dead mount): it is held, and acted on once supervise listens.
        held = HeldStopSignals()
        held.install()
        release.callback(held.restore)
        try:
            session.mount(config.mountpoint, mount_options(config))
        except Exception as err:  # e.g. RuntimeError from fuse_session_mount
            return _mount_failed(config, readiness, err)
        names = ", ".join(d.name for d in daemon.namespace.datasets)
        log.info("mounted %s at %s (datasets: %s; worker processes: %d)", config.store,
                 config.mountpoint, names, config.workers)
        return _serve(config, daemon, readiness, commit, held, release)


@dataclass
class Daemon:
    """What is ready before the mount: the namespace and what serves it."""

    namespace: Namespace
    pool: ChunkPool | None
    staging: PoolServices | None  # the pool's stager, peer server, replication, scrub
    fds_before_mount: set[int]  # /dev/fuse descriptors open before ours
    order: OrderService | None  # samplers' announcements -> the look-ahead
    ckpt: CkptTier | None = None  # the checkpoint tier (--ckpt-store)


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
    ckpt = _ckpt_tier(config, namespace, release)
    order = _order_service(config, namespace, pool)
    if order is not None:
        release.callback(order.lookahead.close)
    return Daemon(namespace, pool, staging, fuse_fds(), order, ckpt)


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
        from dlfsd.pool.peerserver import PeerLoopServer, connection_slots, serve_threads

        server = PeerLoopServer(view.secret, pool, view.me.name,
                                max_connections=connection_slots(len(view.nodes),
                                                                 config.workers),
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


def build_services(config: MountConfig, daemon: Daemon,
                   ckpt: CkptConnection | None) -> Services:
    """The main process's services, once the checkpoint connection (if any) is up."""
    observe = daemon.namespace.observe
    stager = daemon.staging.stager if daemon.staging is not None else None
    health = HealthWatch(observe.requests, config.stall_seconds, observe.path_of,
                         observe.health, observe.peer_marks, daemon.pool, stager)
    return Services(StatusConfig.from_mount(config), daemon.namespace.datasets, observe.stats,
                    health, daemon.staging, ckpt)


def control_server(config: MountConfig, daemon: Daemon) -> ControlServer:
    """The socket of `dlfs trace` and `dlfs flush` (started after the workers fork)."""
    return ControlServer(str(control_socket_path(config.mountpoint)), daemon.namespace.observe,
                         (daemon.order,) if daemon.order is not None else (),
                         ckpt=daemon.ckpt.control if daemon.ckpt is not None else None,
                         ckpt_uid=config.uid)


def _order_service(config: MountConfig, namespace: Namespace, pool) -> OrderService | None:
    """The look-ahead and its socket, made before the workers fork (they share its flag)."""
    if not config.lookahead:
        return None
    lookahead = LookAhead(namespace, pool, config.lookahead_samples, config.lookahead_bytes,
                          config.lookahead_streams, config.store_bandwidth,
                          config.lookahead_stale)
    namespace.observe.add_section("lookahead", lookahead.counter_dict)
    return OrderService(config.mountpoint, lookahead, config.uid)


def _serve(config: MountConfig, daemon: Daemon, readiness: Readiness, commit: LaunchCommit,
           held: HeldStopSignals, release: contextlib.ExitStack) -> int:
    """Mounted: start workers and services, say READY, supervise until unmounted."""
    state = Teardown()
    release.callback(log.info, "unmounted %s; daemon exits", config.mountpoint)
    release.callback(remove_record, config.mountpoint, os.getpid())
    release.callback(lambda: state.aborted and unmount_dead(config.mountpoint))
    release.callback(lambda: session.close(unmount=state.unmount))
    release.callback(daemon.namespace.observe.write_summary, config.summary_file)
    control = control_server(config, daemon)
    release.callback(control.stop)
    release.callback(lambda: stop_workers(list(state.workers)))
    if daemon.staging is not None:
        release.callback(daemon.staging.stop_listening)
    ready = False
    try:
        session.answer_init(INIT_TIMEOUT)
        ours = find_mount(config.mountpoint)  # this connection's device, to know it later
        set_read_ahead(config.mountpoint, config.read_ahead_kb)  # INIT would reset it
        state.workers = start_workers(config, daemon)
        ckpt = None
        if daemon.ckpt is not None:  # after the datasets' workers: they answer its LOOKUP
            ckpt_workers, ckpt = connect(daemon.ckpt, daemon.namespace, release)
            state.workers.update(ckpt_workers)
        services = build_services(config, daemon, ckpt)
        if daemon.order is not None and daemon.order.listen():  # after the workers fork
            release.callback(daemon.order.close)
        # `dlfs trace` (after the workers: it must not serve FUSE, nor hold /dev/fuse)
        control.start(close_in_child=fuse_fds())
        services.listen()  # after the workers: they must not inherit the listener
        write_record(DaemonRecord(os.getpid(), config.mountpoint, config.store, config.log_file,
                                  start_time(os.getpid())))
        write_status(status_path(config.mountpoint), services.status())  # before READY
        readiness.send(READY)
        ready = True
        state.unmount = trio.run(supervise, config.mountpoint, state.workers, services, held,
                                 commit)
        state.aborted = still_mounted(config.mountpoint, ours) if not state.unmount else False
    except DlfsError as err:
        if ready:
            raise
        log.error("%s", err)
        readiness.send(f"{ERROR_PREFIX}{err}")
        return err.exit_code
    return 0


def _mount_failed(config: MountConfig, readiness: Readiness, err: Exception) -> int:
    """An unexpected error before serving: logged with its traceback, one line to
    `dlfs mount`."""
    log.exception("mount failed")
    readiness.send(f"{ERROR_PREFIX}cannot mount {config.mountpoint}: {err}")
    return 1


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
                          config.count_opens, pipe_size).serve()

    return {pid: fuse_fd for pid in fork_workers(config.workers, serve, config.mountpoint)}


class _PrintVersion(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(self.const)
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    """`python -m dlfsd --config JSON [--launcher-version V]`: refuse a launcher of
    another release before anything else (one ERROR line through the readiness pipe),
    else mount and serve."""
    here = str(Path(__file__).resolve().parent)
    parser = argparse.ArgumentParser(
        prog="dlfsd",
        description="DLFS per-node daemon. Normally started by `dlfs mount`; see `dlfs mount -h`.")
    # One line however long the path (argparse's "version" action wraps it): `dlfs
    # --version` reads it.
    parser.add_argument("--version", nargs=0, action=_PrintVersion, default=argparse.SUPPRESS,
                        const=f"dlfsd {__version__} ({here})",
                        help="show the version and where the daemon's code is, and exit")
    parser.add_argument(CONFIG_FLAG, required=True, help="MountConfig as JSON")
    parser.add_argument(VERSION_FLAG, metavar="VERSION",
                        help="the release of the `dlfs` starting us; another one is refused")
    args = parser.parse_args(argv)
    if args.launcher_version is not None:
        refusal = version_refusal(__version__, here, args.launcher_version)
        if refusal:
            print(f"dlfsd: error: {refusal}", file=sys.stderr)
            Readiness().send(f"{ERROR_PREFIX}{refusal}")
            return 1
    return run(MountConfig.from_json(args.config))

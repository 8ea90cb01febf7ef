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
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
    ckpt_mount_path,
    control_socket_path,
    open_log_file,
    read_record,
    remove_record,
    start_time,
    status_path,
    write_record,
)
from dlfs.signals import STOP_SIGNALS, stop_signals_blocked
from dlfs.sizes import format_size
from dlfs.store import nodecache
from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfs.store.store import Dataset, Store
from dlfsd import __version__
from dlfsd.access import served_to_user
from dlfsd.ckpt.nodeids import CKPT_NAME
from dlfsd.commit import LaunchCommit, discard_launch_secret
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse import session
from dlfsd.fuse.ckptworker import CkptWorker
from dlfsd.fuse.wireworker import WORKER_ABORTED, WireWorker, find_fuse_fd, fuse_fds
from dlfsd.kernel import kernel_release, kernel_skips_opens
from dlfsd.lineage import die_with_parent, parent_alive
from dlfsd.lookahead import LookAhead
from dlfsd.namespace import PRIVATE_ROOT_MODE, ROOT_MODE, Namespace
from dlfsd.obs.controlsock import ControlServer
from dlfsd.obs.health import HealthWatch
from dlfsd.obs.observe import Observability, ObserveConfig
from dlfsd.obs.status import build_status, keep_status, write_status
from dlfsd.ordersock import OrderService
from dlfsd.prefetch import available_memory, prefetch_decision

if TYPE_CHECKING:
    from dlfsd.pool.pool import ChunkPool

log = logging.getLogger("dlfsd")

PICK_ANOTHER_PORT = "pick another port (in --nodes; with --slurm or --mpi, --port-base)"
INIT_TIMEOUT = 60.0  # seconds the kernel may take to send FUSE INIT after mounting


def mount_options(config: MountConfig) -> set[str]:
    options = {"fsname=dlfs", "subtype=dlfs", "default_permissions", "noatime"}
    if not config.ckpt_store:  # with a checkpoint tier the core refuses writes (EROFS)
        options.add("ro")
    if config.allow_other or config.uid is not None:
        options.add("allow_other")  # a root-made mount for one user: 0700 root keeps others out
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


def load_pool(config: MountConfig, datasets: list[Dataset]):
    """The chunk pool of a cluster-mode mount (None without --cache-dir)."""
    if not config.pooled:
        return None
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
    pool.cache_limit = limit_for_node(config, pool)
    adopted = pool.scan_caches(pool.cache_limit)
    log.info("chunk pool: node %s of %d, %d replicas, peer port %s:%d, cache %s (%d staged "
             "chunks reused)", view.me.name, len(view.nodes), view.replicas, view.me.host,
             view.me.port, cache_root, adopted)
    dirs, nbytes = pool.foreign_copies()
    if dirs:
        log.warning("cache dir %s also holds %s in %d dataset directories this mount does "
                    "not use (re-populated or removed datasets, or another mount's); they "
                    "count against no --cache-limit: delete those no mount uses", cache_root,
                    format_size(nbytes), dirs)
    return pool


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


async def watch_workers(served: dict[int, int]) -> bool:
    """Reap worker processes as they exit (`served`: pid -> the /dev/fuse descriptor of
    the connection it serves, the datasets' or the checkpoint directory's). Exit code 0
    is a normal end (unmounted).

    A worker that dies while mounted (OOM killer, a bug) held the request it was
    serving: the kernel would wait for that answer forever, and the process that
    asked would hang unkillably. So its requests are handed back to the kernel's
    queue (NOTIFY_RESEND) and the others serve them: dataset requests are idempotent
    (the data never changes); a checkpoint create or rename that the dead worker had
    done but not answered fails when it comes again (EEXIST, ENOENT), which beats a
    hang. Where the kernel
    cannot (< 6.9), or none is left on that connection, we stop the mount instead:
    readers then get ENOTCONN, not a hang. Returns once all are gone, or False as
    soon as the mount must stop.
    """
    with trio.open_signal_receiver(signal.SIGCHLD) as sigs:
        while served:
            for pid in list(served):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done:
                    continue
                fuse_fd = served.pop(pid)
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                    continue
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == WORKER_ABORTED:
                    log.error("the FUSE connection was aborted (umount -f or fusectl)")
                    return False
                how = (f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
                       if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}")
                left = sum(1 for fd in served.values() if fd == fuse_fd)
                if not left:
                    log.error("worker process %d died (%s), the last one of its connection; "
                              "unmounting", pid, how)
                    return False
                try:
                    os.write(fuse_fd, fw.resend_notification())
                except OSError as err:
                    log.error("worker process %d died (%s) and the kernel cannot hand its "
                              "request to the others (%s; Linux >= 6.9 can); unmounting so "
                              "that no reader hangs", pid, how, err.strerror)
                    return False
                log.error("worker process %d died (%s); its unanswered requests went back "
                          "to the queue, %d worker processes serve on", pid, how, left)
            if served:
                await sigs.__anext__()
    return True


class HeldStopSignals:
    """From the mount on, a stop signal outside supervise's own receiver is recorded,
    not acted on: one that comes before the receiver is up stops the daemon as soon as
    it is (a Ctrl-C right after mounting must not leave a dead mount); those that come
    during the unmount (an impatient user, a scheduler repeating TERM) must not kill
    the daemon before it stopped its workers and unmounted, or the workers would go on
    serving a mount nobody takes down. `dlfs umount` ends with SIGKILL if a daemon ever
    hangs."""

    def __init__(self) -> None:
        self.caught: list[int] = []
        self._before: dict[int, object] = {}

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            self._before[signum] = signal.signal(signum, self._record)

    def restore(self) -> None:
        """The handlers from before install (run() may be called in a longer-lived
        process: the foreground CLI, tests)."""
        for signum, handler in self._before.items():
            signal.signal(signum, handler)
        self._before = {}

    def _record(self, signum: int, frame) -> None:
        self.caught.append(signum)


async def supervise(config: MountConfig, workers: dict[int, int], services,
                    held: HeldStopSignals | None = None,
                    commit: LaunchCommit | None = None) -> bool:
    """The main process: run the background services (stager, peer server, status) and
    watch the workers that serve FUSE.

    Returns True if the mount must be unmounted by us (signal, workers died, or the
    launcher went away without committing the mount).
    """
    must_unmount = False
    async with trio.open_nursery() as nursery:
        await nursery.start(services.run)

        def stop() -> None:
            nonlocal must_unmount
            must_unmount = True
            nursery.cancel_scope.cancel()

        async def watch_signals() -> None:
            with trio.open_signal_receiver(*STOP_SIGNALS) as sigs:
                if held is not None and held.caught:  # came before the receiver was up
                    await _send_self(held.caught[0])
                async for signum in sigs:
                    log.info("got %s; unmounting %s", signal.Signals(signum).name,
                             config.mountpoint)
                    stop()
                    return

        async def watch_commit() -> None:
            if not await commit.wait():
                log.error("the `dlfs mount --mpi` rank that started this daemon exited or "
                          "gave up before committing this mount; unmounting %s",
                          config.mountpoint)
                discard_launch_secret(config)
                stop()

        nursery.start_soon(watch_signals)
        if commit is not None and commit.pending:
            nursery.start_soon(watch_commit)
        if not await watch_workers(workers):
            must_unmount = True
            services.connection_lost = True
        nursery.cancel_scope.cancel()
    return must_unmount


class Services:
    """What the main process runs besides FUSE: staging, the peer server, the status file."""

    def __init__(self, config: MountConfig, datasets: list[Dataset], observe: Observability,
                 pool=None) -> None:
        self.config = config
        self.datasets = datasets
        self.stats = observe.stats
        self.pool = pool
        self.stager = None
        self.replicas = None
        self.server = None
        self.scrubber = None
        if pool is not None:
            from dlfsd.pool.stager import Stager

            if len(pool.view.nodes) > 1 and pool.view.replicas > 1 and config.replica_wait:
                from dlfsd.pool.replicate import ReplicaSource

                self.replicas = ReplicaSource(pool.view, datasets, pool.tables,
                                              config.peer_timeout, config.replica_wait)
            self.stager = Stager(datasets, pool.caches, pool.owned, pool.demand,
                                 jobs=config.stage_jobs, cache_limit=pool.cache_limit,
                                 store_rate=config.store_bandwidth, replicas=self.replicas)
            pool.set_stager(self.stager.will_stage)
            if len(pool.view.nodes) > 1:
                from dlfsd.pool.peerprocs import PeerServers, peer_processes
                from dlfsd.pool.peerserver import connection_slots, serve_threads

                self.server = PeerServers(pool.view.secret, pool, pool.view.me.name,
                                          processes=peer_processes(config.peer_procs),
                                          max_connections=connection_slots(
                                              len(pool.view.nodes), config.workers),
                                          trusted=node_addresses(pool.view.nodes),
                                          verify_served=config.verify_served,
                                          threads=serve_threads())
            if config.scrub_rate:
                from dlfsd.pool.scrub import Scrubber

                self.scrubber = Scrubber(pool, config.scrub_rate)
        self.drainer = None  # the checkpoint tier's drain (attach_ckpt)
        self.connection_lost = False  # a connection aborted or its workers died
        self.ckpt_passthrough: str | None = None  # "on", or "off (why)"
        self.health = HealthWatch(observe.requests, config.stall_seconds, observe.path_of,
                                  observe.health, observe.peer_marks, pool, self.stager)

    def _current(self) -> bool:
        """This daemon still serves its mountpoint: no later one has written its record."""
        record = read_record(self.config.mountpoint)
        return record is None or record.pid == os.getpid()

    def status(self) -> dict:
        """The status file's contents; also scans for stalled reads (the status task's
        second is the stall detector's) and publishes the health for .dlfs/metrics."""
        status = build_status(self.config, self.datasets, self.stats, self.stager,
                              self.pool, self.server, self.health.check())
        if self.pool is not None and self.pool.share is not None:
            status["peer_fetch"] = self.pool.fetch_counters()  # the node's, not per worker
        if self.scrubber is not None:
            status["scrub"] = self.scrubber.counters()
        if self.replicas is not None:
            status["replication"] = self.replicas.snapshot()
        if self.drainer is not None:
            status["ckpt"] = self.ckpt_report()
        return status

    def attach_ckpt(self, drainer, written, report) -> None:
        """The checkpoint tier's drain (run here), its write counter and the shared
        report `.dlfs/metrics` renders in the workers."""
        self.drainer, self.ckpt_written, self.ckpt_shared = drainer, written, report

    def ckpt_report(self) -> dict:
        report = self.drainer.report()
        report["written_bytes"], report["write_requests"] = self.ckpt_written.totals()
        report["passthrough"] = self.ckpt_passthrough
        self.ckpt_shared.publish(report)
        return report

    def listen(self, close_in_child=()) -> None:
        """Take the peer port now, before READY: check_port_free only looked, and a
        port taken since (another job's daemon on this node) must fail the mount with
        one line, not end the daemon after `dlfs mount` said it is up. The server's
        processes must not hold `close_in_child` (/dev/fuse)."""
        if self.server is None:
            return
        me = self.pool.view.me
        for port in me.ports:  # taken since take_free_port looked: the next one
            try:
                self.server.start(me.host, port, close_in_child)
                return
            except OSError as err:
                error = err
        raise DlfsError(f"cannot listen for peers on {me.host}:{'/'.join(map(str, me.ports))}: "
                        f"{error.strerror}; {PICK_ANOTHER_PORT}") from None

    def stop_listening(self) -> None:
        if self.server is not None:
            self.server.stop()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                if self.stager is not None:
                    nursery.start_soon(self.stager.run)
                if self.scrubber is not None:
                    nursery.start_soon(self.scrubber.run)
                if self.drainer is not None:  # threads: started after every fork
                    self.drainer.start()
                if self.server is not None:
                    nursery.start_soon(self.server.watch)
                nursery.start_soon(keep_status, status_path(self.config.mountpoint),
                                   self.status, self._current)
                task_status.started()
        finally:
            self.stop_listening()
            if self.replicas is not None:
                self.replicas.close()
            if self.drainer is not None:
                if self.connection_lost:
                    self.drainer.finish(drain_on_loss())
                self.drainer.stop()


def run(config: MountConfig, readiness: Readiness | None = None) -> int:
    """Mount and serve; returns the process exit code.

    Every resource is released by one ExitStack, in the reverse order it was
    taken, whichever step fails: the order lives where each is acquired.
    """
    readiness = readiness or Readiness()
    commit = LaunchCommit.from_env()
    configure_logging(config)
    with contextlib.ExitStack() as release:
        try:
            daemon = _load(config, release)
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
class _Loaded:
    """What is ready before the mount: the namespace and what serves it."""

    namespace: Namespace
    pool: ChunkPool | None
    services: Services
    fds_before_mount: set[int]  # /dev/fuse descriptors open before ours
    order: OrderService | None  # samplers' announcements -> the look-ahead
    ckpt: object | None = None  # dlfsd.ckpt.control.CkptControl: `dlfs flush`
    open_files: object | None = None  # dlfsd.ckpt.openfiles.OpenFiles: ckpt/'s open files


def _load(config: MountConfig, release: contextlib.ExitStack) -> _Loaded:
    """Datasets, chunk pool, namespace and the services, before mounting."""
    datasets = load_datasets(config)
    pool = load_pool(config, datasets)
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
    services = Services(config, namespace.datasets, namespace.observe, pool)
    ckpt, open_files = _ckpt_tier(config, namespace, services, release)
    order = _order_service(config, namespace, pool)
    if order is not None:
        release.callback(order.lookahead.close)
    return _Loaded(namespace, pool, services, fuse_fds(), order, ckpt, open_files)


def _ckpt_tier(config: MountConfig, namespace: Namespace, services: Services,
               release: contextlib.ExitStack):
    """The writable `ckpt/` subtree, its drain, and its open-files table ((None, None)
    without --ckpt-store); made before the fork: the workers share its epoch word,
    write counter and open files."""
    if not config.ckpt_store:
        return None, None
    from dlfsd.ckpt.control import CkptControl
    from dlfsd.ckpt.counters import WriteCounter
    from dlfsd.ckpt.drain import Drainer, scan
    from dlfsd.ckpt.openfiles import OpenFiles
    from dlfsd.ckpt.tier import Tier
    from dlfsd.ckpt.tree import CkptTree
    from dlfsd.obs.sharedjson import SharedJson

    # Every file operation of the tier runs as the job's user (docs/SECURITY.md)
    tier = Tier(config.cache_dir, config.ckpt_store, ckpt_creds(config))
    release.callback(tier.close)
    tier.state.reset_nodes(tier.root_ino)
    undrained = scan(tier)  # resume: files an earlier mount did not drain
    written = WriteCounter(namespace.observe.slot)
    where, link = ckpt_mountpoint(config)
    namespace.attach_ckpt(CkptTree(tier, written, config.ckpt_limit_wait), link)
    report = SharedJson()
    namespace.observe.add_section("ckpt", report.read)
    open_files = OpenFiles(str(tier.root / ".open"))
    namespace.ckpt.open_files = open_files  # the union never replaces a file being written
    services.attach_ckpt(Drainer(tier, config.drain_jobs, config.drain_bandwidth,
                                 config.ckpt_idle, config.ckpt_limit, config.ckpt_keep,
                                 open_files=open_files),
                         written, report)
    log.info("checkpoint directory %s/ckpt%s: written to %s, drained to %s%s",
             config.mountpoint, f" (a symlink to {where})" if link else "", tier.tree,
             tier.store,
             f" ({len(undrained)} files from an earlier mount still to drain)"
             if undrained else "")
    return CkptControl(tier), open_files


def ckpt_creds(config: MountConfig):
    """The credentials the checkpoint tier acts with: the mount's --uid/--gid user (a
    root daemon mounting for a job), else the daemon's own."""
    from dlfsd.ckpt.creds import Creds
    if config.uid is None:
        return Creds.none()
    return Creds.for_user(config.uid, config.gid if config.gid is not None else config.uid)


DRAIN_ON_LOSS_VAR = "DLFS_CKPT_DRAIN_ON_LOSS"  # seconds; default DRAIN_ON_LOSS
DRAIN_ON_LOSS = 120.0


def drain_on_loss() -> float:
    """How long a daemon whose connection was lost keeps draining checkpoints before it
    exits (the epilog's flush cannot reach it then)."""
    try:
        return max(0.0, float(os.environ.get(DRAIN_ON_LOSS_VAR, DRAIN_ON_LOSS)))
    except ValueError:
        return DRAIN_ON_LOSS


PASSTHROUGH_VAR = "DLFS_CKPT_PASSTHROUGH"  # 0: checkpoint bytes through the daemon


def passthrough_wanted(config: MountConfig) -> tuple[bool, str]:
    """Whether to ask the kernel for FUSE passthrough on the checkpoint connection, and
    why (for the log and status): the kernel then writes and reads checkpoint files'
    local copies itself. It needs CAP_SYS_ADMIN; and --ckpt-limit needs every write to
    pass through the daemon, which makes it wait for room (docs/CKPT.md)."""
    if os.environ.get(PASSTHROUGH_VAR) == "0":
        return False, f"off ({PASSTHROUGH_VAR}=0)"
    if os.geteuid() != 0:
        return False, "off (needs root)"
    if config.ckpt_limit:
        return False, "off (--ckpt-limit: writes wait for room in the daemon)"
    return True, "on"


def _order_service(config: MountConfig, namespace: Namespace, pool) -> OrderService | None:
    """The look-ahead and its socket, made before the workers fork (they share its flag)."""
    if not config.lookahead:
        return None
    lookahead = LookAhead(namespace, pool, config.lookahead_samples, config.lookahead_bytes,
                          config.lookahead_streams, config.store_bandwidth,
                          config.lookahead_stale)
    namespace.observe.add_section("lookahead", lookahead.counter_dict)
    return OrderService(config.mountpoint, lookahead, config.uid)


def _serve(config: MountConfig, daemon: _Loaded, readiness: Readiness, commit: LaunchCommit,
           held: HeldStopSignals, release: contextlib.ExitStack) -> int:
    """Mounted: start workers and services, say READY, supervise until unmounted."""
    namespace, services = daemon.namespace, daemon.services
    state = _Teardown()
    release.callback(log.info, "unmounted %s; daemon exits", config.mountpoint)
    release.callback(remove_record, config.mountpoint, os.getpid())
    release.callback(lambda: state.aborted and _unmount_dead(config.mountpoint))
    release.callback(lambda: session.close(unmount=state.unmount))
    release.callback(namespace.observe.write_summary, config.summary_file)
    control = ControlServer(str(control_socket_path(config.mountpoint)), namespace.observe,
                            (daemon.order,) if daemon.order is not None else (),
                            ckpt=daemon.ckpt, ckpt_uid=config.uid)
    release.callback(control.stop)
    release.callback(lambda: stop_workers(list(state.workers)))
    release.callback(services.stop_listening)
    ready = False
    try:
        session.answer_init(INIT_TIMEOUT)
        ours = find_mount(config.mountpoint)  # this connection's device, to know it later
        set_read_ahead(config.mountpoint, config.read_ahead_kb)  # INIT would reset it
        state.workers = start_workers(config, namespace, daemon.fds_before_mount, daemon.pool)
        if daemon.ckpt is not None:  # after the datasets' workers: they answer its LOOKUP
            state.workers.update(_mount_ckpt(config, daemon, release))
        if daemon.order is not None and daemon.order.listen():  # after the workers fork
            release.callback(daemon.order.close)
        # `dlfs trace` (after the workers: it must not serve FUSE, nor hold /dev/fuse)
        control.start(close_in_child=fuse_fds())
        services.listen(fuse_fds())  # after the workers: they must not inherit the listener
        write_record(DaemonRecord(os.getpid(), config.mountpoint, config.store, config.log_file,
                                  start_time(os.getpid())))
        write_status(status_path(config.mountpoint), services.status())  # before READY
        readiness.send(READY)
        ready = True
        state.unmount = trio.run(supervise, config, state.workers, services, held, commit)
        state.aborted = _still_mounted(config.mountpoint, ours) if not state.unmount else False
    except DlfsError as err:
        if ready:
            raise
        log.error("%s", err)
        readiness.send(f"{ERROR_PREFIX}{err}")
        return err.exit_code
    return 0


@dataclass
class _Teardown:
    """What the release callbacks of a mounted daemon must know when they run."""

    workers: dict[int, int] = field(default_factory=dict)  # pid -> its /dev/fuse descriptor
    unmount: bool = True  # unless the kernel already unmounted us (fusermount3 -u)
    aborted: bool = False  # the connection was aborted and the dead mount is still there


def ckpt_mountpoint(config: MountConfig) -> tuple[str, bytes | None]:
    """Where the checkpoint connection is mounted, and the symlink target MOUNTPOINT/ckpt
    shows (None: it is mounted on MOUNTPOINT/ckpt itself, as a root daemon does; one
    that is not root mounts through fusermount3, which cannot reach inside our mount:
    see dlfs.runtime.ckpt_mount_path)."""
    if os.geteuid() == 0:
        return os.path.join(config.mountpoint, CKPT_NAME.decode()), None
    where = ckpt_mount_path(config.mountpoint)
    where.mkdir(mode=0o700, exist_ok=True)
    return str(where), os.fsencode(where)


def _mount_ckpt(config: MountConfig, daemon: _Loaded,
                release: contextlib.ExitStack) -> dict[int, int]:
    """Mount the checkpoint directory's own connection on MOUNTPOINT/ckpt, answer its
    INIT (asking for passthrough if wanted) and fork its workers."""
    from dlfsd.fuse.rawsession import RawSession

    uid = os.getuid() if config.uid is None else config.uid
    gid = os.getgid() if config.gid is None else config.gid
    before = fuse_fds()
    ckpt = RawSession(ckpt_mountpoint(config)[0], uid, gid,
                      config.allow_other or config.uid is not None)
    try:
        ckpt.mount()
    except OSError as err:
        raise DlfsError(f"cannot mount the checkpoint directory: {err.strerror}") from None
    release.callback(ckpt.unmount)
    wanted, why = passthrough_wanted(config)
    try:
        negotiated = ckpt.answer_init(INIT_TIMEOUT, wanted)
    except (OSError, TimeoutError) as err:
        raise DlfsError(f"cannot start the checkpoint directory {ckpt.mountpoint}: {err}") \
            from None
    if wanted and not negotiated.passthrough:
        why = (f"off (kernel {kernel_release()} does not offer FUSE passthrough; "
               "Linux >= 6.9 with CONFIG_FUSE_PASSTHROUGH does)")
    daemon.services.ckpt_passthrough = why
    daemon.services.drainer.passthrough = negotiated.passthrough
    log.info("checkpoint directory %s: its own FUSE connection (protocol 7.%d), "
             "passthrough %s", ckpt.mountpoint, negotiated.minor, why)
    return start_ckpt_workers(config, daemon.namespace, ckpt.fd, before, daemon.open_files,
                              negotiated.passthrough)


def _mount_failed(config: MountConfig, readiness: Readiness, err: Exception) -> int:
    """An unexpected error before serving: logged with its traceback, one line to
    `dlfs mount`."""
    log.exception("mount failed")
    readiness.send(f"{ERROR_PREFIX}cannot mount {config.mountpoint}: {err}")
    return 1


def _still_mounted(mountpoint: str, ours) -> bool:
    """Our mount (same device: not one mounted there since by another daemon) is still
    at `mountpoint`."""
    now = find_mount(mountpoint)
    return ours is not None and now is not None and now.device == ours.device


def _unmount_dead(mountpoint: str) -> None:
    """The workers saw the connection end, yet our mount is still there: it was
    aborted (fusectl, umount -f) and answers ENOTCONN for good. libfuse leaves an
    aborted connection's mount alone, so take it down here, lazily (a process may
    still have it as its cwd)."""
    log.error("the FUSE connection was aborted with %s still mounted; unmounting it",
              mountpoint)
    try:
        done = subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.error("cannot unmount %s: %s; run `dlfs umount %s`", mountpoint, err, mountpoint)
        return
    if done.returncode:
        log.error("cannot unmount %s: %s; run `dlfs umount %s`", mountpoint,
                  done.stderr.strip(), mountpoint)


async def _send_self(signum: int) -> None:
    """Deliver a held signal again, now to the receiver that is listening."""
    signal.raise_signal(signum)
    await trio.lowlevel.checkpoint()


def start_workers(config: MountConfig, namespace: Namespace, fds_before_mount: set[int],
                  pool=None) -> dict[int, int]:
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
    uid = os.getuid() if config.uid is None else config.uid  # owner shown for every entry
    gid = os.getgid() if config.gid is None else config.gid
    fuse_fd = find_fuse_fd(fds_before_mount)
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


def start_ckpt_workers(config: MountConfig, namespace: Namespace, ckpt_fd: int,
                       close_fds: set[int], open_files,
                       passthrough: bool) -> dict[int, int]:
    """Fork the processes serving the checkpoint connection (dlfsd.fuse.ckptworker):
    as many as the datasets have (a checkpoint save writes from every rank at once;
    with passthrough the bytes never reach them, and they idle in read())."""
    uid = os.getuid() if config.uid is None else config.uid
    gid = os.getgid() if config.gid is None else config.gid
    tree = namespace.ckpt

    def serve() -> int:
        for fd in close_fds:  # the datasets' connection is not ours to hold
            with contextlib.suppress(OSError):
                os.close(fd)
        return CkptWorker(namespace, tree, ckpt_fd, uid, gid, open_files, passthrough).serve()

    return {pid: ckpt_fd for pid in fork_workers(config.workers, serve, config.mountpoint)}


def fork_workers(count: int, serve: Callable[[], int], mountpoint: str) -> list[int]:
    """Fork `count` processes, each running `serve` until it returns its exit code."""
    pids = []
    parent = os.getpid()
    for _ in range(count):
        with stop_signals_blocked():  # until the worker's own handlers are in (serve)
            pid = os.fork()
            if pid == 0:  # worker: serve until unmount or SIGTERM, then leave, no cleanup
                code = 0
                try:
                    # SIGTERM when the main process dies (SIGKILL, OOM): a worker must not
                    # serve on unsupervised, holding the mount up (dlfsd.lineage).
                    if die_with_parent(parent):
                        code = serve()
                    if not parent_alive(parent):
                        log.error("worker %d stops: the main daemon process %d died (killed?); "
                                  "the mount ends with its last worker (readers get "
                                  "ENOTCONN until `dlfs umount %s`)", os.getpid(), parent,
                                  mountpoint)
                except BaseException:
                    log.exception("worker %d failed", os.getpid())
                    code = 1
                finally:
                    logging.shutdown()
                    os._exit(code)
        pids.append(pid)
    return pids


def stop_workers(pids, timeout: float = 10.0) -> None:
    """Ask the workers not reaped yet to stop, and reap them (SIGKILL after `timeout`)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)


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

"""What the main process runs besides FUSE: staging, the peer server, the status file,
the checkpoint drain.

The forked workers serve every FUSE request; the main process runs these in its
trio loop and threads (dlfsd.supervise starts them and watches the workers), so
none of them ever waits behind a blocking FUSE handler. Each part is built
elsewhere (dlfsd.assemble, dlfsd.ckptconnect) from its own settings and handed
in whole; Services only runs, reports and stops them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from dlfs.errors import DlfsError
from dlfs.runtime import read_record, status_path
from dlfs.store.store import Dataset
from dlfsd.obs.health import HealthWatch
from dlfsd.obs.status import StatusConfig, build_status, keep_status

if TYPE_CHECKING:
    from dlfsd.ckptconnect import CkptConnection
    from dlfsd.pool.peerprocs import PeerServers
    from dlfsd.pool.pool import ChunkPool
    from dlfsd.pool.replicate import ReplicaSource
    from dlfsd.pool.scrub import Scrubber
    from dlfsd.pool.stager import Stager


PICK_ANOTHER_PORT = "pick another port (in --nodes; with --slurm or --mpi, --port-base)"


@dataclass
class PoolServices:
    """What the main process runs for a chunk pool; made before the fork (the stager
    decides what the pool stages, and the workers demand chunks through the pool)."""

    pool: ChunkPool
    stager: Stager
    replicas: ReplicaSource | None = None  # secondary owners copy from primaries
    server: PeerServers | None = None  # other nodes read our staged copies
    scrubber: Scrubber | None = None  # --scrub-rate: re-reads the staged copies

    def report(self, status: dict) -> None:
        """Add the node's pool counters to the status file's contents."""
        if self.pool.share is not None:
            status["peer_fetch"] = self.pool.fetch_counters()  # the node's, not per worker
        if self.scrubber is not None:
            status["scrub"] = self.scrubber.counters()
        if self.replicas is not None:
            status["replication"] = self.replicas.snapshot()

    def listen(self, close_in_child: Sequence[int] = ()) -> None:
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

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.stager.run)
        if self.scrubber is not None:
            nursery.start_soon(self.scrubber.run)
        if self.server is not None:
            nursery.start_soon(self.server.watch)

    def stop(self) -> None:
        self.stop_listening()
        if self.replicas is not None:
            self.replicas.close()


class Services:
    """What the main process runs besides FUSE: staging, the peer server, the status
    file, the checkpoint drain. Made once all of them exist (the drain only after
    the checkpoint connection's INIT said whether the kernel passes bytes through);
    supervise runs them."""

    def __init__(self, status: StatusConfig, datasets: list[Dataset], stats,
                 health: HealthWatch, staging: PoolServices | None = None,
                 ckpt: CkptConnection | None = None, fuse: dict | None = None,
                 passthrough: Callable[[], dict] | None = None) -> None:
        """`stats`: the mount's dlfsd.obs.stats.Stats (NullStats under --no-stats);
        `fuse`: what the datasets' INIT granted (dlfsd.fuse.session.report);
        `passthrough`: the report of large files by passthrough (dlfsd.core.passthrough)."""
        self.config = status
        self.datasets = datasets
        self.stats = stats
        self.health = health
        self.staging = staging
        self.ckpt = ckpt
        self.fuse_connection = fuse
        self.passthrough = passthrough
        self.connection_lost = False  # a connection aborted or its workers died

    def _current(self) -> bool:
        """This daemon still serves its mountpoint: no later one has written its record."""
        record = read_record(self.config.mountpoint)
        return record is None or record.pid == os.getpid()

    def status(self) -> dict:
        """The status file's contents; also scans for stalled reads (the status task's
        second is the stall detector's) and publishes the health for .dlfs/metrics."""
        staging = self.staging
        pool, stager, server = ((staging.pool, staging.stager, staging.server)
                                if staging is not None else (None, None, None))
        status = build_status(self.config, self.datasets, self.stats, stager, pool, server,
                              self.health.check())
        if staging is not None:
            staging.report(status)
        if self.ckpt is not None:
            status["ckpt"] = self.ckpt.report()
        if self.fuse_connection is not None:
            status["fuse"] = self.fuse_connection
        if self.passthrough is not None:
            status["passthrough"] = self.passthrough()
        return status

    def listen(self, close_in_child: Sequence[int] = ()) -> None:
        """Take the peer port (see PoolServices.listen)."""
        if self.staging is not None:
            self.staging.listen(close_in_child)

    def stop_listening(self) -> None:
        if self.staging is not None:
            self.staging.stop_listening()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                if self.staging is not None:
                    self.staging.start(nursery)
                if self.ckpt is not None:  # threads: started after every fork
                    self.ckpt.start()
                nursery.start_soon(keep_status, status_path(self.config.mountpoint),
                                   self.status, self._current)
                task_status.started()
        finally:
            if self.staging is not None:
                self.staging.stop()
            if self.ckpt is not None:
                self.ckpt.stop(self.connection_lost)

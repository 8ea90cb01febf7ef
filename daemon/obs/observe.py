"""Observability: the counters, the trace and the `.dlfs/` files of one mount, together.

Made once, before the workers fork (everything that must be shared lives in
shared memory by then). The Namespace owns it and calls the hot-path pieces;
the daemon's lifecycle calls `serve_control` (main process), `write_summary`
at unmount and `close`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from dlfs.config import MountConfig
from dlfs.obs.statsview import text_summary
from dlfs.runtime import open_log_file
from dlfs.store.store import Dataset
from dlfsd.base.kernel import workers_answer_opens
from dlfsd.base.slots import ProcessSlot
from dlfsd.obs.control import ControlFiles
from dlfsd.obs.peermarks import PeerMarks
from dlfsd.obs.prometheus import prometheus_text
from dlfsd.obs.sharedjson import SharedJson
from dlfsd.obs.stalls import NO_REQUESTS, NullRequests, RequestSlots
from dlfsd.obs.stats import TOP_FILES, NullStats, Stats
from dlfsd.obs.trace import DEFAULT_CAPACITY, Trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObserveConfig:
    enabled: bool = True  # counters (and the trace); False is `--no-stats`
    processes: int = 1  # daemon processes that will record (main + workers)
    trace_capacity: int = DEFAULT_CAPACITY
    opens_counted: bool = True  # the daemon answers opens (False: FUSE no_open)
    stall_seconds: float = 10.0  # a read outstanding this long is a stall (0: not watched)

    @classmethod
    def from_mount(cls, config: MountConfig) -> ObserveConfig:
        # The main process, plus the forked FUSE workers.
        return cls(enabled=config.stats, processes=1 + config.workers,
                   trace_capacity=config.trace_capacity,
                   opens_counted=workers_answer_opens(config.count_opens),
                   stall_seconds=config.stall_seconds)


class Observability:
    """Counters + trace + `.dlfs/` for the (sorted) datasets of a Namespace."""

    def __init__(self, datasets: list[Dataset], config: ObserveConfig) -> None:
        self.config = config
        self.slot = ProcessSlot(config.processes)
        self.stats: Stats | NullStats = NullStats()
        if config.enabled:
            self.stats = Stats([d.name for d in datasets], [d.directory for d in datasets],
                               self.slot)
            self.stats.opens_counted = config.opens_counted
        # Without counters the trace cannot start (see start_trace): one record suffices.
        capacity = config.trace_capacity if config.enabled else 1
        # With workers (processes > 1) the main process serves no requests.
        self.trace = Trace(capacity, self.slot, max(1, config.processes - 1))
        self.datasets = datasets
        self._sections: dict[str, Callable[[], dict]] = {}
        self.requests = self._request_slots(config)
        self.peer_marks: PeerMarks | None = None  # a chunk pool's (watch_pool)
        # The main process's health report (dlfsd.obs.health), for `.dlfs/metrics`.
        self.health = SharedJson()
        if config.enabled:
            self.add_section("health", self.health.read)
        self.control = ControlFiles({b"stats.json": self.render_stats_json,
                                     b"metrics": self.render_metrics}, self.slot)

    def _request_slots(self, config: ObserveConfig) -> RequestSlots | NullRequests:
        """The stall detector's slots: one per daemon process (the main process's is
        used only where tests serve requests in it); none with counters off or
        --stall-seconds 0."""
        if not (config.enabled and config.stall_seconds > 0):
            return NO_REQUESTS
        return RequestSlots.for_processes(self.slot)

    def watch_pool(self, pool) -> None:
        """Let the main process see the peer marks every process of a chunk pool makes
        and the peer each read waits for (call before the fork)."""
        self.peer_marks = PeerMarks(self.slot, len(pool.view.nodes))
        pool.report_to(self.requests, self.peer_marks)

    def close(self) -> None:
        self.requests.close()
        if self.peer_marks is not None:
            self.peer_marks.close()
        self.health.close()
        self.control.close()
        self.trace.close()
        self.stats.close()

    # -- renderers of `.dlfs/` ----------------------------------------------------------
    def snapshot(self, top_files: int = TOP_FILES) -> dict:
        """The counters, plus what other parts of the daemon report (e.g. the look-ahead's
        prefetched bytes, counted in its own process: `add_section`)."""
        snapshot = self.stats.snapshot(top_files)
        if snapshot.get("enabled", True):
            for name, render in self._sections.items():
                snapshot[name] = render()
        return snapshot

    def add_section(self, name: str, render: Callable[[], dict]) -> None:
        """Report `render()` under `name` in every snapshot (call before the fork)."""
        self._sections[name] = render

    def render_stats_json(self) -> bytes:
        return (json.dumps(self.snapshot(), indent=1) + "\n").encode()

    def render_metrics(self) -> bytes:
        return prometheus_text(self.snapshot(top_files=0)).encode()  # not exported

    # -- trace control (called by dlfsd.obs.controlsock) -------------------------------------
    def start_trace(self) -> None:
        if not self.stats.enabled:
            raise ValueError("counters and tracing are off on this mount (--no-stats)")
        self.trace.start()

    def trace_status(self) -> dict:
        dump = self.trace.dump()
        return {"tracing": dump.running, "records": int(dump.records.size),
                "dropped": dump.dropped, "capacity": dump.capacity,
                "started_ns": dump.started_ns, "stopped_ns": dump.stopped_ns}

    def path_of(self, ds: int, row: int) -> str:
        """Path of a file relative to the mountpoint (the dataset's root is its name)."""
        from dlfs.store.directory import display_path

        d = self.datasets[ds]
        path = display_path(d.directory.path(row))
        return f"{d.name}/{path}" if path else d.name

    # -- the end of the job ---------------------------------------------------------------
    def write_summary(self, path: str | None) -> None:
        """Log the text summary; with a path, also write the final snapshot there (JSON).

        The file is what a Slurm epilogue keeps: the stats.json content plus
        "summary" (the text lines). Written to a temporary name and renamed.
        """
        snapshot = self.snapshot()
        lines = text_summary(snapshot)
        for line in lines:
            log.info("summary: %s", line)
        if not path:
            return
        snapshot["summary"] = lines
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            fd = open_log_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # 0640
            with os.fdopen(fd, "w") as f:
                json.dump(snapshot, f, indent=1)
                f.write("\n")
            os.replace(tmp, path)
        except OSError as err:
            log.error("cannot write the summary file %s: %s", path, err.strerror or err)

"""The daemon's live status: staging progress, where reads were served from, and health.

The main process rewrites one small JSON file in the runtime directory every
second (atomically); `dlfs status MOUNTPOINT` reads it. Nothing on the read
path waits for this.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from dlfs.config import MountConfig
from dlfs.store.store import Dataset
from dlfsd.obs.stats import SOURCE_NAMES

log = logging.getLogger(__name__)

STATUS_INTERVAL = 1.0


def _sources(by_dataset: dict, name: str) -> dict:
    """requests, bytes and mean latency per source (local/peer/store) of one dataset."""
    counted = by_dataset.get(name, {})
    out = {}
    for source in SOURCE_NAMES:
        c = counted.get(source, {"reads": 0, "bytes": 0, "latency_ns_sum": 0})
        mean = round(c["latency_ns_sum"] / c["reads"] / 1000, 1) if c["reads"] else 0.0
        out[source] = {"requests": c["reads"], "bytes": c["bytes"], "mean_latency_us": mean}
    return out


@dataclass(frozen=True)
class StatusConfig:
    """What the status file says of the mount's settings (the rest is measured)."""

    mountpoint: str
    store: str
    log_file: str | None = None  # None: the daemon logs to stderr
    cache_dir: str | None = None  # a chunk pool's (None: no pool)
    cache_limit: int = 0  # --cache-limit as given (0: none)

    @classmethod
    def from_mount(cls, config: MountConfig) -> StatusConfig:
        return cls(mountpoint=config.mountpoint, store=config.store, log_file=config.log_file,
                   cache_dir=config.cache_dir, cache_limit=config.cache_limit)


def build_status(config: StatusConfig, datasets: list[Dataset], stats, stager=None, pool=None,
                 server=None, health: dict | None = None) -> dict:
    """`stats` is the mount's dlfsd.obs.stats.Stats (or NullStats under --no-stats);
    `health` what dlfsd.obs.health.HealthWatch.check found (stalls, peers, staging)."""
    progress = stager.progress() if stager is not None else None
    sources = stats.sources()
    adopted_reads = stats.adopted()
    out: dict = {
        "mountpoint": config.mountpoint,
        "store": config.store,
        "pid": os.getpid(),
        "log": config.log_file or "stderr",  # where checksum errors and the like go
        "updated": time.time(),
        "pooled": config.cache_dir is not None,
        "datasets": [],
    }
    if pool is not None:
        out.update(node=pool.view.me.name, nodes=[str(n) for n in pool.view.nodes],
                   replicas=pool.view.replicas, cache_dir=config.cache_dir,
                   cache_limit=config.cache_limit)
    for ds, dataset in enumerate(datasets):
        entry = {"name": dataset.name, "chunks": dataset.chunk_count,
                 "bytes": int(dataset.stats["bytes"]), "sources": _sources(sources, dataset.name)}
        if progress is not None:
            p = progress[ds]
            entry["staging"] = {"owned_chunks": p.owned_chunks, "owned_bytes": p.owned_bytes,
                                "staged_chunks": p.staged_chunks, "staged_bytes": p.staged_bytes,
                                "rate": p.rate, "eta": p.eta}
        if pool is not None:
            entry["node_cache"] = node_cache_entry(pool.caches[ds],
                                                   adopted_reads.get(dataset.name, {}))
        out["datasets"].append(entry)
    if server is not None:
        out["peer_server"] = server.counters()
    if health is not None:
        out["health"] = health
    return out


def node_cache_entry(cache, reads: dict) -> dict:
    """Cache hits from earlier jobs for one dataset: the copies adopted at mount (and
    how many of them are still the current copy), what this mount staged itself, and
    the local reads the adopted copies served."""
    staged, adopted = cache.staged_mask(), cache.adopted_mask() & cache.staged_mask()
    lengths = cache.lengths
    return {"adopted_at_mount": cache.adopted_at_mount,
            "adopted_chunks": int(adopted.sum()), "adopted_bytes": int(lengths[adopted].sum()),
            "staged_now_chunks": int((staged & ~adopted).sum()),
            "staged_now_bytes": int(lengths[staged & ~adopted].sum()),
            "reads": reads.get("reads", 0), "bytes": reads.get("bytes", 0)}


def write_status(path: Path, status: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per daemon: see keep_status
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)


async def keep_status(path: Path, render, current: Callable[[], bool]) -> None:
    """Rewrite the status file every STATUS_INTERVAL until cancelled; remove it then.

    A failure here is logged once and never stops the daemon: status is a view.
    Once `current()` says another daemon serves the mountpoint now (this one was
    detached by a lazy unmount and the mountpoint mounted again), the file is that
    daemon's: we stop writing it and leave it in place.
    """
    failed = wrote = False
    try:
        while True:
            if not current():
                wrote = False
                return
            try:
                write_status(path, render())
                wrote = True
            except Exception:
                if not failed:
                    log.exception("cannot write the status file %s; will keep trying", path)
                failed = True
            await trio.sleep(STATUS_INTERVAL)
    finally:
        if wrote and current():
            with contextlib.suppress(OSError):
                path.unlink()

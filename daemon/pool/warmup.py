"""Warm-up: stage a node's share of datasets into its cache dir before a job runs.

`dlfs warmup` (e.g. `srun -N4 dlfs warmup --slurm --store S imagenet --cache-dir
/nvme/dlfs`) runs the daemon's own Stager in the foreground, without a mount:
the same placement (node names, replicas: what the later job's mounts compute),
the same copies (copied in the kernel, read back and every extent checked, then
renamed into place), the same cache layout. A later mount of the dataset on
that node adopts the copies, and a job whose nodes were all warmed reads
nothing from the store. The dataset is marked in use while warming (`dlfs cache
prune` leaves it alone).
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trio

from dlfs.cluster.placement import owners
from dlfs.errors import DlfsError
from dlfs.sizes import format_size
from dlfs.store.store import Dataset
from dlfsd.pool.chunkcache import ChunkCache
from dlfsd.pool.stager import DemandChannel, Stager

POLL = 0.05  # seconds between checks for the end
REPORT_EVERY = 4  # checks between progress lines


@dataclass(frozen=True)
class WarmupPlan:
    datasets: list[Dataset]
    cache_dir: Path
    node_names: tuple[str, ...]
    node: int  # this node's index in node_names
    replicas: int = 1
    jobs: int = 4
    store_rate: int = 0  # benchmarks only (a throttled store)
    stall_seconds: float = 120.0  # no chunk staged for this long with work left: give up


@dataclass(frozen=True)
class WarmupResult:
    owned_chunks: int
    owned_bytes: int
    reused_chunks: int  # staged before (an earlier job or warm-up)
    copied_bytes: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.copied_bytes / self.seconds if self.seconds else 0.0


def warmup(plan: WarmupPlan, report=None) -> WarmupResult:
    """Stage this node's share; `report(line)` gets a progress line now and then."""
    owned = [(owners(d.uuid, d.chunk_count, list(plan.node_names), plan.replicas)
              == plan.node).any(axis=1) for d in plan.datasets]
    caches = [ChunkCache(plan.cache_dir, d) for d in plan.datasets]
    demand = DemandChannel()
    try:
        for cache in caches:
            cache.scan()  # adopt what an earlier job or warm-up staged
        reused = sum(int((c.staged_mask() & mask).sum())
                     for c, mask in zip(caches, owned, strict=True))
        stager = Stager(plan.datasets, caches, owned, demand, jobs=plan.jobs,
                        store_rate=plan.store_rate)
        started = time.monotonic()
        trio.run(_stage, stager, plan.stall_seconds, report or (lambda line: None))
        seconds = time.monotonic() - started
    finally:
        demand.close()
        for cache in caches:
            cache.close()
    lengths = [d.chunk_lengths[m] for d, m in zip(plan.datasets, owned, strict=True)]
    return WarmupResult(int(sum(m.sum() for m in owned)),
                        int(sum(int(np.sum(x)) for x in lengths)), reused,
                        stager.copied_bytes, seconds)


async def _stage(stager: Stager, stall_seconds: float, report) -> None:
    """Run the stager until this node's share is staged; DlfsError if it stalls."""
    missing = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stager.run)
        last_staged, last_change = -1, time.monotonic()
        for tick in itertools.count():
            progress = stager.progress()
            staged = sum(p.staged_chunks for p in progress)
            if staged != last_staged:
                last_staged, last_change = staged, time.monotonic()
            if tick % REPORT_EVERY == 0:
                report(progress_line(progress))
            if all(p.staged_chunks == p.owned_chunks for p in progress):
                break
            if time.monotonic() - last_change > stall_seconds:
                missing = sum(p.owned_chunks - p.staged_chunks for p in progress)
                break
            await trio.sleep(POLL)
        nursery.cancel_scope.cancel()
    if missing:  # raised out here: inside the nursery it would come wrapped in a group
        raise DlfsError(f"warm-up stalled: {missing} chunks not staged after "
                        f"{stall_seconds:.0f} s without progress (the store or the cache dir "
                        "fails: see the lines above)")


def progress_line(progress) -> str:
    owned = sum(p.owned_bytes for p in progress)
    staged = sum(p.staged_bytes for p in progress)
    rate = max((p.rate for p in progress), default=0.0)
    etas = [p.eta for p in progress]
    eta = "unknown" if any(e is None for e in etas) else f"{max(etas, default=0.0):.0f} s"
    pct = 100.0 * staged / owned if owned else 100.0
    return (f"{format_size(staged)} of {format_size(owned)} staged ({pct:.0f}%), "
            f"{format_size(int(rate))}/s, ETA {eta}")


def print_progress(line: str, stream=sys.stderr) -> None:
    """One progress line, rewritten in place on a terminal, appended elsewhere (logs)."""
    if stream.isatty():
        stream.write("\r\x1b[K" + line)
    else:
        stream.write(line + "\n")
    stream.flush()

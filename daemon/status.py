"""The daemon's live status: staging progress and where reads were served from.

The main process rewrites one small JSON file in the runtime directory every
second (atomically); `dlfs status MOUNTPOINT` reads it. Nothing on the read
path waits for this.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import trio

from dlfs.config import MountConfig
from dlfs.store import Dataset
from dlfsd.sources import SourceCounters

STATUS_INTERVAL = 1.0


def build_status(config: MountConfig, datasets: list[Dataset], counters: SourceCounters,
                 stager=None, pool=None, server=None) -> dict:
    progress = stager.progress() if stager is not None else None
    out: dict = {
        "mountpoint": config.mountpoint,
        "store": config.store,
        "pid": os.getpid(),
        "updated": time.time(),
        "pooled": config.pooled,
        "datasets": [],
    }
    if pool is not None:
        out.update(node=pool.view.me.name, nodes=[str(n) for n in pool.view.nodes],
                   replicas=pool.view.replicas, cache_dir=config.cache_dir,
                   cache_limit=config.cache_limit)
    for ds, dataset in enumerate(datasets):
        entry = {"name": dataset.name, "chunks": dataset.chunk_count,
                 "bytes": int(dataset.stats["bytes"]), "sources": counters.as_dict(ds)}
        if progress is not None:
            p = progress[ds]
            entry["staging"] = {"owned_chunks": p.owned_chunks, "owned_bytes": p.owned_bytes,
                                "staged_chunks": p.staged_chunks, "staged_bytes": p.staged_bytes,
                                "rate": p.rate, "eta": p.eta}
        out["datasets"].append(entry)
    if server is not None:
        out["peer_server"] = {name: int(getattr(server, name)) for name in dir(server)
                              if not name.startswith("_")
                              and isinstance(getattr(server, name), int)}
    return out


def write_status(path: Path, status: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)


async def keep_status(path: Path, render) -> None:
    """Rewrite the status file every STATUS_INTERVAL until cancelled; remove it then."""
    try:
        while True:
            with contextlib.suppress(OSError):
                write_status(path, render())
            await trio.sleep(STATUS_INTERVAL)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()

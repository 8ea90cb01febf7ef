"""MountConfig: everything a user can tune about one mount, in one place.

The CLI fills it from flags; the daemon receives it serialized (JSON) when
`dlfs mount` starts it in the background, so the two never disagree.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field


def default_workers() -> int:
    """Worker processes serving FUSE requests: one per core, at least 4, at most 8.

    A worker serves one request at a time and nothing else while it waits for a disk
    or a peer, so even a node with 1 or 2 cores gets 4, to keep reads in flight while
    some wait. The cap bounds what idle workers cost on big nodes (each is a process
    with buffers of its own). To measure another count on a node:
    bench/random_read.py --mount-args='--workers N'."""
    return min(8, max(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class MountConfig:
    mountpoint: str
    store: str
    datasets: tuple[str, ...] = ()  # empty: every dataset of the store
    verify: bool = True  # check each extent's checksum the first time it is read
    workers: int = field(default_factory=default_workers)  # forked processes serving FUSE
    cache_timeout: float = 86400.0  # entry/attr timeout: data is immutable
    read_ahead_kb: int = 4096  # kernel read-ahead for the mount (0: keep the default)
    allow_other: bool = False
    uid: int | None = None  # present every file as owned by uid:gid, root dir 0700 (prolog)
    gid: int | None = None
    debug: bool = False
    log_file: str | None = None
    stats: bool = True  # I/O counters and the trace; off (--no-stats) only to measure their cost
    # Send every open/close to the daemon (counted, traced). Off: the kernel opens files
    # itself (FUSE no_open), so a page-cache hit costs no daemon round trip at all.
    count_opens: bool = False
    # Worker processes answer large reads of verified bytes by splice(2) from the chunk
    # file (one kernel copy instead of two); off only to measure what it saves.
    splice: bool = True
    prefetch: str = "auto"  # read a chunk whole on its first sample read (dlfsd.core.prefetch)
    trace_capacity: int = 1 << 20  # trace records kept (oldest dropped beyond)
    summary_file: str | None = None  # final counters + text summary, written at unmount
    # A read outstanding this long is a stall: logged once, counted, shown by `dlfs status`
    # and .dlfs/metrics (a hung peer, a stuck store); 0: not watched.
    stall_seconds: float = 10.0
    # Seconds the kernel waits for the daemon to answer a request before it aborts the
    # connection (FUSE_REQUEST_TIMEOUT, Linux >= 6.14; 0: forever): readers of a hung or
    # stopped daemon then get an error instead of hanging in D state. Longer than a
    # parallel file system's failover, which a read may wait out.
    request_timeout: int = 600
    # Large files (a quarter chunk or more) read by the kernel from verified whole-file
    # copies in cache_dir (FUSE passthrough; root, Linux >= 6.9): "auto" when they hold
    # most of the bytes (every open is then answered), "on", "off" (dlfsd.core.passthrough).
    passthrough: str = "auto"
    # -- the chunk pool (cluster mode: on when cache_dir is set) --
    cache_dir: str | None = None  # node-local NVMe directory for staged chunks
    nodes: tuple[str, ...] = ()  # NAME=HOST:PORT of every daemon of the job; empty: just us
    node: str | None = None  # our entry in `nodes` (default: this host's short name)
    replicas: int = 1  # owners per chunk
    # Seconds a secondary owner waits for a chunk from its primary before copying it from
    # the store (0: every owner copies from the store; dlfsd.pool.replicate).
    replica_wait: float = 30.0
    secret_file: str | None = None  # per-job secret (mode 0600) peers authenticate with
    cache_limit: int = 0  # bytes of staged chunks at most (0: no limit)
    node_cache_limit: int = 0  # bytes the whole cache dir may hold, all datasets (0: none)
    stage_jobs: int = 2  # chunks copied from the store at once
    peer_timeout: float = 5.0  # seconds per peer call before trying elsewhere
    store_bandwidth: int = 0  # bytes/s per store read stream; only to model a slow store
    # The peer server checks each extent the first time the current copy serves it.
    verify_served: bool = False
    # Forked processes serving peers (None: auto, dlfsd.pool.peerprocs.peer_processes;
    # 0: loop threads in the daemon's main process, the old way)
    peer_procs: int | None = None
    scrub_rate: int = 0  # bytes/s the staged copies are re-read and checked at (0: never)
    # -- the look-ahead (dlfsd.core.lookahead): reads announced epochs ahead of the readers --
    lookahead: bool = True  # listen for samplers' announcements (off: --lookahead 0)
    lookahead_samples: int = 256  # samples fetched ahead of the readers, at most
    lookahead_bytes: int = 256 << 20  # bytes fetched ahead, at most
    # fetches at once, (MIN, MAX): the width follows the readers (one paced store stream each)
    lookahead_streams: tuple[int, int] = (8, 32)
    lookahead_stale: float = 60.0  # seconds without a read before an announcement is dropped
    # a fetch thread's peer extents go out together, pipelined per owner (off, the default:
    # one at a time; readers faster than the look-ahead waited for whole rounds)
    lookahead_pipeline: bool = False
    # fetch peers' extents ahead into PeerShare (off: the readers fetch them themselves;
    # the look-ahead still stages, reads the store and asks the page cache ahead)
    lookahead_peers: bool = True

    # -- the checkpoint tier (dlfsd.ckpt, docs/CKPT.md): needs cache_dir --
    ckpt_store: str | None = None  # store directory MOUNTPOINT/ckpt/ drains to (None: no tier)
    drain_bandwidth: int = 0  # bytes/s all drain copies together (0: as fast as they go)
    drain_jobs: int = 2  # files copied to the checkpoint store at once
    ckpt_idle: float = 2.0  # seconds without a write before an unclosed file is drained
    ckpt_limit: int = 0  # bytes the local copies may take (0: no limit, nothing evicted)
    ckpt_keep: int = 1  # newest checkpoints (top-level entries of ckpt/) never evicted
    ckpt_limit_wait: float = 60.0  # seconds a write waits for room before ENOSPC

    @property
    def pooled(self) -> bool:
        return self.cache_dir is not None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> MountConfig:
        data = json.loads(text)
        data["datasets"] = tuple(data.get("datasets", ()))
        data["nodes"] = tuple(data.get("nodes", ()))
        if "lookahead_streams" in data:
            data["lookahead_streams"] = tuple(data["lookahead_streams"])
        return cls(**data)

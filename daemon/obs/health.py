"""HealthWatch: what is wrong with a mount right now, gathered once a second by the main process.

Reads stalled past `--stall-seconds` (dlfsd.obs.stalls), peers the pool's
processes skip (dlfsd.obs.peermarks) and what keeps owned chunks off this
node's NVMe (the stager's own state: over `--cache-limit`, demanded and not
staged yet, copies failing, the cache disk refusing writes). The status task
calls `check()` every second; the result goes into the status file (`dlfs
status`) and is published in shared memory for `.dlfs/metrics`, which a
worker process renders (dlfsd.obs.sharedjson).

The pool and the stager are used through what they offer (duck typing): this
layer sits below dlfsd.pool and must not import it.
"""

from __future__ import annotations

from dlfsd.obs.peermarks import PeerHealth, PeerMarks
from dlfsd.obs.sharedjson import SharedJson
from dlfsd.obs.stalls import NullRequests, RequestSlots, StallWatch

LISTED = 16  # stalled reads and peers listed by name; the rest are counted


class HealthWatch:
    """The main process's view of the mount's health (see the module doc)."""

    def __init__(self, requests: RequestSlots | NullRequests, stall_seconds: float,
                 path_of, published: SharedJson | None = None,
                 peer_marks: PeerMarks | None = None, pool=None, stager=None) -> None:
        self.pool = pool
        self.stager = stager
        self.peer_marks = peer_marks
        self.published = published
        self.stall_seconds = stall_seconds if requests.enabled else 0.0
        self.stalls = StallWatch(requests, stall_seconds, path_of, self._peer_name)

    def _peer_name(self, node: int) -> str:
        nodes = self.pool.view.nodes if self.pool is not None else ()
        return nodes[node].name if 0 <= node < len(nodes) else f"#{node}"

    def check(self) -> dict:
        """Scan and gather now (logs newly stalled reads); publish for `.dlfs/metrics`."""
        report = self._stall_report()
        if self.peer_marks is not None:
            report.update(self._peer_report(self.peer_marks.report()))
        if self.stager is not None:
            report["staging"] = self._staging_report(self.stager.health())
        if self.published is not None:
            self.published.publish(report, _counts_only(report))
        return report

    def _stall_report(self) -> dict:
        stalled, oldest = self.stalls.scan()
        return {"stall_seconds": self.stall_seconds,
                "stalls_total": self.stalls.stalls_total(),
                "stalls_by_source": dict(self.stalls.total),
                "stalled_reads": len(stalled),
                "stalled": [s.as_dict() for s in stalled[:LISTED]],
                "oldest_read_seconds": round(oldest, 1)}

    def _peer_report(self, peers: list[PeerHealth]) -> dict:
        listed = sorted(peers, key=lambda p: (-p.down_processes, -p.bad_processes,
                                              -p.down_marks - p.bad_marks))
        return {"peers_down": sum(1 for p in peers if p.down_processes),
                "peers_with_bad_copies": sum(1 for p in peers if p.bad_processes),
                "peers": [self._peer_dict(p) for p in listed[:LISTED]]}

    def _peer_dict(self, p: PeerHealth) -> dict:
        names = [d.name for d in self.pool.datasets] if self.pool is not None else []
        return {"name": self._peer_name(p.node), "down_processes": p.down_processes,
                "down_seconds_left": round(p.down_seconds_left, 1), "down_why": p.down_why,
                "down_marks": p.down_marks, "bad_copy_processes": p.bad_processes,
                "bad_copy_seconds_left": round(p.bad_seconds_left, 1),
                "bad_copy_marks": p.bad_marks,
                "bad_copy_dataset": names[p.bad_ds] if 0 <= p.bad_ds < len(names) else None,
                "bad_copy_chunk": p.bad_chunk if p.bad_chunk >= 0 else None}

    def _staging_report(self, h) -> dict:
        """`h`: the stager's StagingHealth (lists by dataset index)."""
        datasets = {}
        for ds, dataset in enumerate(self.stager.datasets):
            example = h.failing_example[ds]
            datasets[dataset.name] = {
                "over_limit_chunks": h.over_limit_chunks[ds],
                "over_limit_bytes": h.over_limit_bytes[ds],
                "demanded_chunks": h.demanded_chunks[ds],
                "demanded_oldest_seconds": round(h.demanded_oldest[ds], 1),
                "failing_chunks": h.failing_chunks[ds],
                "failing_example": None if example is None else {
                    "chunk": example[0], "error": example[1],
                    "retry_seconds": None if example[2] is None else round(example[2], 1)}}
        paused = None if h.paused is None else {"seconds_left": round(h.paused[0], 1),
                                                "error": h.paused[1]}
        return {"datasets": datasets, "copy_errors": h.copy_errors,
                "cache_limit": h.cache_limit, "paused": paused}


def _counts_only(report: dict) -> dict:
    """The report without its lists (what is published if it is too large to share)."""
    return {k: v for k, v in report.items() if k not in ("stalled", "peers")}

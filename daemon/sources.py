"""Per-source read counters (local NVMe, peer, store), shared by all daemon processes.

One anonymous shared mapping, created before the workers fork, holds one
slab per process, so processes never write the same word and no update is
lost; readers of the counters sum the slabs.
"""

from __future__ import annotations

import mmap

import numpy as np

SOURCE_LOCAL, SOURCE_PEER, SOURCE_STORE = 0, 1, 2
SOURCE_NAMES = ("local", "peer", "store")
_FIELDS = 3  # requests, bytes, latency_ns


class SourceCounters:
    """requests/bytes/latency per (dataset, source), summed over processes."""

    def __init__(self, datasets: int, processes: int) -> None:
        self._shape = (max(1, processes), max(1, datasets), len(SOURCE_NAMES), _FIELDS)
        self._map = mmap.mmap(-1, int(np.prod(self._shape)) * 8)
        self._all = np.frombuffer(self._map, dtype=np.int64).reshape(self._shape)
        self._mine = self._all[0]

    def use_slab(self, index: int) -> None:
        """Called in a forked worker: write to its own slab from now on."""
        self._mine = self._all[index]

    def record_source(self, ds: int, source: int, nbytes: int, latency_ns: int) -> None:
        row = self._mine[ds, source]
        row[0] += 1
        row[1] += nbytes
        row[2] += latency_ns

    def totals(self) -> np.ndarray:
        """(datasets, sources, [requests, bytes, latency_ns]) summed over processes."""
        return self._all.sum(axis=0)

    def as_dict(self, ds: int) -> dict:
        t = self.totals()[ds]
        return {name: {"requests": int(t[i, 0]), "bytes": int(t[i, 1]),
                       "mean_latency_us": round(t[i, 2] / t[i, 0] / 1000, 1) if t[i, 0] else 0.0}
                for i, name in enumerate(SOURCE_NAMES)}

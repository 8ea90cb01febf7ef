"""What the sampler needs from a DLFS mount, as a small protocol.

The real client (dlfs.order.client) talks to the node's daemon; tests hand in a
client that returns synthetic locality. This module imports nothing but numpy,
so the client can import `Locality` from here without importing the sampler
(the sampler imports the client: the other direction would be a cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Locality:
    """Where the samples live, as one node's daemon sees it.

    Every rank must get the same `sample_chunk`, `chunk_node` and `node_count`
    (e.g. derived from placement, which every node computes alike): the plan is
    computed independently on each rank and only agrees if its inputs do.
    """

    sample_chunk: np.ndarray  # int64 per sample: a chunk key (index into chunk_node); -1 = unknown
    chunk_node: np.ndarray  # int32 per chunk key: node index holding it; -1 = none known
    node_count: int
    node: int  # the node index of the rank that asked


class OrderClient(Protocol):
    """A connection to the daemon of the mount the samples are read through."""

    def locality(self) -> Locality: ...

    def announce(self, epoch: int, order: np.ndarray) -> None:
        """This rank's sample indices for `epoch`, in read order (once per epoch)."""
        ...

    def close(self) -> None: ...


def check_locality(loc: Locality, n_samples: int) -> str | None:
    """Why `loc` cannot plan `n_samples` samples, or None when it can.

    A client bug must not become a wrong plan (samples lost or doubled), so the
    sampler checks shapes and ranges once and falls back to random order.
    """
    sc, cn = np.asarray(loc.sample_chunk), np.asarray(loc.chunk_node)
    if sc.ndim != 1 or len(sc) != n_samples:
        return f"sample_chunk has shape {sc.shape}, the dataset has {n_samples} samples"
    if cn.ndim != 1:
        return f"chunk_node has shape {cn.shape}, not one dimension"
    if not np.issubdtype(sc.dtype, np.integer) or not np.issubdtype(cn.dtype, np.integer):
        return f"sample_chunk/chunk_node must be integer arrays, not {sc.dtype}/{cn.dtype}"
    if loc.node_count < 1:
        return f"node_count is {loc.node_count}"
    if not 0 <= loc.node < loc.node_count:
        return f"node {loc.node} is not in 0..{loc.node_count - 1}"
    if len(sc) and (sc.min() < -1 or sc.max() >= len(cn)):
        return f"sample_chunk values must lie in -1..{len(cn) - 1}"
    if len(cn) and (cn.min() < -1 or cn.max() >= loc.node_count):
        return f"chunk_node values must lie in -1..{loc.node_count - 1}"
    return None

"""Placement: which nodes own which chunks (rendezvous hashing).

Each (chunk, node) pair gets a pseudo-random weight; a chunk's owners are the
R nodes with the highest weights. Every daemon computes the same table from
the dataset id and the node names alone (not addresses, not list order), and
removing a node only moves the chunks it owned: every other chunk keeps its
top-R nodes. Weights are computed with numpy for all chunks at once.
"""

from __future__ import annotations

import numpy as np
import xxhash


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijective avalanche on uint64 (vectorized)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def weights(dataset_id: bytes, chunk_count: int, node_names: list[str]) -> np.ndarray:
    """(chunks, nodes) uint64 weights; a pure function of the id, chunk index and node name."""
    node_keys = np.array([xxhash.xxh3_64_intdigest(dataset_id + name.encode())
                          for name in node_names], dtype=np.uint64)
    chunk_keys = _mix(np.arange(chunk_count, dtype=np.uint64)
                      ^ np.uint64(xxhash.xxh3_64_intdigest(dataset_id)))
    with np.errstate(over="ignore"):
        return _mix(chunk_keys[:, None] * np.uint64(0x9E3779B97F4A7C15) ^ node_keys[None, :])


def owners(dataset_id: bytes, chunk_count: int, node_names: list[str],
           replicas: int) -> np.ndarray:
    """(chunks, R) node indices, best first: row c lists the owners of chunk c."""
    if not node_names:
        return np.zeros((chunk_count, 0), dtype=np.int32)
    r = min(replicas, len(node_names))
    w = weights(dataset_id, chunk_count, node_names)
    # Highest weight first; stable order so equal weights (never seen) break by index.
    order = np.argsort(~w, axis=1, kind="stable")
    return order[:, :r].astype(np.int32)


def summary(table: np.ndarray, chunk_lengths: np.ndarray, node_count: int
            ) -> list[tuple[int, int, int]]:
    """Per node: (chunks owned as primary, chunks owned as any replica, bytes of those)."""
    rows = []
    for node in range(node_count):
        mine = (table == node).any(axis=1)
        primary = int((table[:, 0] == node).sum()) if table.shape[1] else 0
        rows.append((primary, int(mine.sum()), int(chunk_lengths[mine].sum())))
    return rows

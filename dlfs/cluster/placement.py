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


BLOCK_CELLS = 1 << 21  # (chunk, node) weights computed at once: 16 MiB of uint64


def owners(dataset_id: bytes, chunk_count: int, node_names: list[str],
           replicas: int) -> np.ndarray:
    """(chunks, R) node indices, best first: row c lists the owners of chunk c.

    Computed a block of chunks at a time, the top R of each row picked by a
    partial sort: the whole (chunks, nodes) weight matrix and a full argsort of it
    cost 24 bytes per cell and O(N log N) per row (1,000 nodes, 200,000 chunks:
    4.6 GB and 52 s at every mount; docs/SCALE.md)."""
    if not node_names:
        return np.zeros((chunk_count, 0), dtype=np.int32)
    r = min(replicas, len(node_names))
    table = np.empty((chunk_count, r), dtype=np.int32)
    step = max(1, BLOCK_CELLS // len(node_names))
    for start in range(0, chunk_count, step):
        stop = min(start + step, chunk_count)
        table[start:stop] = _top(_block_weights(dataset_id, start, stop, node_names), r)
    return table


def _block_weights(dataset_id: bytes, start: int, stop: int,
                   node_names: list[str]) -> np.ndarray:
    """weights() of chunks [start, stop) only (the same values)."""
    node_keys = np.array([xxhash.xxh3_64_intdigest(dataset_id + name.encode())
                          for name in node_names], dtype=np.uint64)
    chunk_keys = _mix(np.arange(start, stop, dtype=np.uint64)
                      ^ np.uint64(xxhash.xxh3_64_intdigest(dataset_id)))
    with np.errstate(over="ignore"):
        return _mix(chunk_keys[:, None] * np.uint64(0x9E3779B97F4A7C15) ^ node_keys[None, :])


def _top(w: np.ndarray, r: int) -> np.ndarray:
    """Per row, the indices of the r highest weights, highest first; equal weights
    (never seen in 64-bit hashes) by lower index, as a stable full sort would."""
    keys = ~w  # ascending keys = descending weights
    if r < w.shape[1]:
        cand = np.argpartition(keys, r - 1, axis=1)[:, :r]
        # The r-th key's ties may sit outside cand: take every index with a key not
        # above the r-th smallest, then order those stably.
        kth = np.take_along_axis(keys, cand, axis=1).max(axis=1, keepdims=True)
        if int((keys <= kth).sum()) != keys.shape[0] * r:  # a tie at the edge
            return np.argsort(keys, axis=1, kind="stable")[:, :r].astype(np.int32)
        cand.sort(axis=1)  # by index, so the stable sort below breaks ties by index
    else:
        cand = np.broadcast_to(np.arange(w.shape[1]), w.shape).copy()
    order = np.argsort(np.take_along_axis(keys, cand, axis=1), axis=1, kind="stable")
    return np.take_along_axis(cand, order, axis=1).astype(np.int32)


def summary(table: np.ndarray, chunk_lengths: np.ndarray, node_count: int
            ) -> list[tuple[int, int, int]]:
    """Per node: (chunks owned as primary, chunks owned as any replica, bytes of those)."""
    rows = []
    for node in range(node_count):
        mine = (table == node).any(axis=1)
        primary = int((table[:, 0] == node).sum()) if table.shape[1] else 0
        rows.append((primary, int(mine.sum()), int(chunk_lengths[mine].sum())))
    return rows

"""Epoch plans: which samples each rank reads, in which order (pure numpy).

A plan is an int64 array of shape (world, num_samples); row r is rank r's
order. The same inputs give the same plan on every rank, so the ranks never
need to talk to each other about it (docs/ORDER.md).

Both modes start from the same epoch multiset, drawn exactly like torch's
DistributedSampler does: a uniform permutation of the N samples, padded by
repeating its head up to total_size (or cut to total_size with drop_last).
Random mode then deals it out round-robin, as DistributedSampler does;
locality mode deals the same multiset out by chunk and node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    """Locality inputs of a plan, already checked (seam.check_locality)."""

    sample_chunk: np.ndarray  # int64 per sample, -1 = unknown
    chunk_node: np.ndarray  # int64 per chunk key, -1 = none known
    rank_nodes: np.ndarray  # int64 per rank: the node it runs on
    node_count: int


def shard_sizes(n: int, world: int, drop_last: bool) -> tuple[int, int]:
    """(total_size, num_samples), exactly as torch's DistributedSampler computes them."""
    # with drop_last and a remainder: ceil((n - world) / world), 0 when n < world
    num = -((world - n) // world) if drop_last and n % world else -(-n // world)
    return num * world, num


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """Seeded by seed + epoch, as DistributedSampler seeds its torch.Generator."""
    return np.random.default_rng(seed + epoch)


def epoch_pool(n: int, total: int, rng: np.random.Generator) -> np.ndarray:
    """The epoch's samples in uniform random order, padded or cut to `total`.

    np.resize repeats the array from its head, which is DistributedSampler's
    padding both when the padding is shorter than the list and when it is longer.
    """
    return np.resize(rng.permutation(n), total)


def random_plan(n: int, world: int, seed: int, epoch: int, drop_last: bool) -> np.ndarray:
    """DistributedSampler's plan: rank r reads pool[r::world]."""
    total, num = shard_sizes(n, world, drop_last)
    pool = epoch_pool(n, total, epoch_rng(seed, epoch))
    return np.ascontiguousarray(pool.reshape(num, world).T)


def locality_plan(layout: Layout, world: int, seed: int, epoch: int, drop_last: bool,
                  window: int) -> np.ndarray:
    """Each node's ranks read mostly the chunks that node holds (DeepIO's ordering).

    Each node gets a quota of (its ranks) x num_samples items. It is filled with
    its own chunks' samples in this epoch's chunk order; what does not fit spills
    to nodes under quota, whole chunks first. A node's items are cut among its
    ranks, and each rank reads its chunks `window` at a time, shuffled within.
    """
    n = len(layout.sample_chunk)
    total, num = shard_sizes(n, world, drop_last)
    if total == 0:
        return np.zeros((world, 0), dtype=np.int64)
    rng = epoch_rng(seed, epoch)
    pool = epoch_pool(n, total, rng)  # the same multiset random mode would read
    return locality_deal(layout, pool, num, window, rng)


def locality_deal(layout: Layout, pool: np.ndarray, num: int, window: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Deal `pool` (world x num items, already padded or cut) out by chunk and node.

    The second half of `locality_plan`, on its own so that a resumed epoch can
    deal the samples it has left (dlfs.order.resume) by the same rules.
    """
    world = len(layout.rank_nodes)
    if num == 0:
        return np.zeros((world, 0), dtype=np.int64)
    keys, key_node = _item_keys(layout, pool)
    prio = rng.permutation(len(key_node))  # this epoch's chunk order
    quota = np.bincount(layout.rank_nodes, minlength=layout.node_count).astype(np.int64) * num
    dest = _assign_nodes(keys, key_node, prio, quota)
    positions = _rank_orders(dest, keys, prio, layout, num, window, rng)
    return pool[positions]


def _item_keys(layout: Layout, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chunk key of each pool item, and the node of each key.

    A sample of unknown chunk gets a key of its own (a chunk of one, on no node),
    so the rest of the plan needs no special case for it.
    """
    keys = layout.sample_chunk[pool].astype(np.int64)
    unknown = np.flatnonzero(keys < 0)
    base = len(layout.chunk_node)
    keys[unknown] = base + np.arange(len(unknown), dtype=np.int64)
    key_node = np.concatenate([layout.chunk_node.astype(np.int64),
                               np.full(len(unknown), -1, dtype=np.int64)])
    return keys, key_node


def _assign_nodes(keys: np.ndarray, key_node: np.ndarray, prio: np.ndarray,
                  quota: np.ndarray) -> np.ndarray:
    """The node that reads each item: its chunk's node up to that node's quota."""
    nodes = len(quota)
    home = key_node[keys]
    home = np.where(home >= 0, home, nodes)  # `nodes` = held by no node
    order = np.argsort(home * len(prio) + prio[keys], kind="stable")
    sorted_home = home[order]
    starts = np.searchsorted(sorted_home, np.arange(nodes + 1))
    pos = np.arange(len(order)) - starts[sorted_home]
    keep = pos < np.append(quota, 0)[sorted_home]
    dest = np.full(len(keys), -1, dtype=np.int64)
    dest[order[keep]] = sorted_home[keep]
    deficit = quota - np.bincount(sorted_home[keep], minlength=nodes + 1)[:nodes]
    surplus = order[~keep]
    surplus = surplus[np.argsort(prio[keys[surplus]], kind="stable")]
    _spill(surplus, keys[surplus], deficit, dest)
    return dest


def _spill(surplus: np.ndarray, surplus_keys: np.ndarray, deficit: np.ndarray,
           dest: np.ndarray) -> None:
    """Give the surplus items (grouped by chunk, in chunk order) to nodes under quota.

    Whole chunks first, longest first, each to the node short of the most items
    if it fits there (a chunk read whole is one stream from its holder); then the
    rest, item by item, fills the remaining gaps in node order.
    """
    if len(surplus) == 0:
        return
    starts = np.flatnonzero(np.r_[True, surplus_keys[1:] != surplus_keys[:-1]])
    lengths = np.diff(np.r_[starts, len(surplus)])
    taken = np.zeros(len(starts), dtype=bool)
    gaps = [(-int(d), node) for node, d in enumerate(deficit) if d > 0]
    heapq.heapify(gaps)
    for piece in np.argsort(-lengths, kind="stable"):
        length = int(lengths[piece])
        if length < 2 or not gaps or -gaps[0][0] < 2:
            break
        if length > -gaps[0][0]:
            continue
        neg, node = heapq.heappop(gaps)
        if -neg > length:
            heapq.heappush(gaps, (neg + length, node))
        dest[surplus[starts[piece]:starts[piece] + length]] = node
        deficit[node] -= length
        taken[piece] = True
    rest = surplus[~np.repeat(taken, lengths)]
    slots = np.repeat(np.arange(len(deficit)), deficit)
    assert len(slots) == len(rest), "quotas must add up to the epoch's items"
    dest[rest] = slots


def _rank_orders(dest: np.ndarray, keys: np.ndarray, prio: np.ndarray, layout: Layout,
                 num: int, window: int, rng: np.random.Generator) -> np.ndarray:
    """(world, num) item positions: each node's items cut among its ranks, windowed.

    A node's items are laid out in this epoch's chunk order and cut into
    consecutive slices of num items, one per rank of the node (ranks ascending).
    Within a rank, its chunks are taken `window` at a time and the samples of
    each group shuffled: at most `window` chunks are being read at once.
    """
    nodes = layout.node_count
    seq = np.argsort(dest * len(prio) + prio[keys], kind="stable")
    seq_node = dest[seq]
    item_start = np.searchsorted(seq_node, np.arange(nodes))
    ranks_by_node = np.argsort(layout.rank_nodes, kind="stable")
    rank_start = np.searchsorted(layout.rank_nodes[ranks_by_node], np.arange(nodes))
    within = np.arange(len(seq)) - item_start[seq_node]
    seq_rank = ranks_by_node[rank_start[seq_node] + within // num]
    seq_keys = keys[seq]
    new_rank = np.r_[True, seq_rank[1:] != seq_rank[:-1]]
    new_run = new_rank | np.r_[True, seq_keys[1:] != seq_keys[:-1]]
    run = np.cumsum(new_run) - 1
    run_in_rank = run - np.maximum.accumulate(np.where(new_rank, run, 0))
    group = run_in_rank // window
    final = np.lexsort((rng.random(len(seq)), group, seq_rank))
    return seq[final].reshape(len(layout.rank_nodes), num)

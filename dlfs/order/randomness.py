"""How random an epoch's order is, in figures a user can trade locality against.

`entropy_figure`: for every batch of `batch_size` consecutive samples of a
rank, the Shannon entropy of its chunk mix (which chunks its samples come from,
in what proportions); the mean over all batches of all ranks, divided by the
mean a uniform shuffle of the same samples would give in expectation (exact,
hypergeometric, no sampling noise), clipped to [0, 1]. A uniform shuffle scores
~1; reading chunk after chunk scores ~0. Chunk mix stands in for everything that
is clustered by chunk (a class directory is packed into neighbouring chunks).

`epoch_relation`: how much one epoch repeats the previous one: the correlation
of each sample's read step in the two epochs (~0 for independent shuffles) and
the fraction of samples read by the same rank again (~1/world for random order;
locality keeps a node's chunks on that node's ranks).

All numpy, O(n log n): about a second for a million samples.
"""

from __future__ import annotations

import numpy as np


def plan_chunk_keys(plan: np.ndarray, sample_chunk: np.ndarray) -> np.ndarray:
    """The chunk key of every plan item; a sample of unknown chunk is its own chunk."""
    keys = sample_chunk[plan].astype(np.int64)
    span = int(sample_chunk.max(initial=-1)) + 1
    return np.where(keys >= 0, keys, span + plan)


def entropy_figure(keys: np.ndarray, batch_size: int) -> float:
    """Mean batch chunk-mix entropy of `keys` (world x num), over a uniform shuffle's."""
    if keys.size == 0:
        return 1.0
    sizes, batches = np.unique(_batch_sizes(keys.shape[1], batch_size), return_counts=True)
    _, counts = np.unique(keys, return_counts=True)
    expected = sum(int(m) * _expected_entropy(counts, int(s))
                   for s, m in zip(sizes, batches, strict=True)) / int(batches.sum())
    if expected <= 0:
        return 1.0  # one chunk, or batches of one: nothing to mix
    return float(min(1.0, _mean_batch_entropy(keys, batch_size) / expected))


def _batch_sizes(row_len: int, batch_size: int) -> np.ndarray:
    """Sizes of the batches one row is cut into (the last may be short)."""
    full, rest = divmod(row_len, batch_size)
    return np.array([batch_size] * full + ([rest] if rest else []), dtype=np.int64)


def _mean_batch_entropy(keys: np.ndarray, batch_size: int) -> float:
    """Mean over all batches (all rows) of the Shannon entropy of their key mix."""
    rows, length = keys.shape
    per_row = -(-length // batch_size)
    batch = (np.arange(rows)[:, None] * per_row
             + np.arange(length)[None, :] // batch_size).ravel()
    span = int(keys.max()) + 1
    pairs, counts = np.unique(batch * span + keys.ravel(), return_counts=True)
    owner = pairs // span
    p = counts / np.bincount(batch)[owner]
    return float(np.bincount(owner, weights=-p * np.log(p)).sum() / (rows * per_row))


def _expected_entropy(counts: np.ndarray, size: int) -> float:
    """E[entropy of the key mix] of `size` items drawn without replacement.

    Key k holds counts[k] of the total items; its count in the draw is
    hypergeometric. Computed once per distinct count, with log-factorials.
    """
    total = int(counts.sum())
    distinct, multiplicity = np.unique(counts, return_counts=True)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, total + 1)))])
    j = np.arange(1, size + 1)[None, :]
    c = distinct[:, None]
    valid = (j <= c) & (size - j <= total - c)
    jj, cc = np.where(valid, j, 0), np.where(valid, c, 0)
    log_pmf = (_log_choose(log_fact, cc, jj) + _log_choose(log_fact, total - cc, size - jj)
               - _log_choose(log_fact, np.int64(total), np.int64(size)))
    share = j / size
    terms = np.where(valid, np.exp(log_pmf) * -share * np.log(share), 0.0)
    return float((terms.sum(axis=1) * multiplicity).sum())


def _log_choose(log_fact: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
    n, k = np.asarray(n), np.asarray(k)
    return log_fact[n] - log_fact[k] - log_fact[np.maximum(n - k, 0)]


def read_steps(plan: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: the step it is first read at (-1: not this epoch) and by which rank."""
    world = plan.shape[0]
    flat = plan.T.ravel()  # step by step, ranks in order: the job's read order
    first_samples, first = np.unique(flat, return_index=True)
    step = np.full(n, -1, dtype=np.int64)
    rank = np.full(n, -1, dtype=np.int64)
    step[first_samples] = first // world
    rank[first_samples] = first % world
    return step, rank


def epoch_relation(now: tuple[np.ndarray, np.ndarray],
                   before: tuple[np.ndarray, np.ndarray]) -> tuple[float | None, float | None]:
    """(correlation of read steps, fraction read by the same rank) of two epochs."""
    both = (now[0] >= 0) & (before[0] >= 0)
    if both.sum() < 2:
        return None, None
    same_rank = float((now[1][both] == before[1][both]).mean())
    a, b = now[0][both].astype(np.float64), before[0][both].astype(np.float64)
    if a.std() == 0 or b.std() == 0:
        return None, same_rank
    return float(np.corrcoef(a, b)[0, 1]), same_rank


def local_fraction(order: np.ndarray, sample_chunk: np.ndarray, chunk_node: np.ndarray,
                   node: int) -> float | None:
    """The share of `order` whose chunk `node` holds."""
    if len(order) == 0:
        return None
    keys = sample_chunk[order]
    if len(chunk_node) == 0:  # no chunk known (every sample's key is -1)
        return 0.0
    holder = np.where(keys >= 0, chunk_node[np.maximum(keys, 0)], -1)
    return float((holder == node).mean())

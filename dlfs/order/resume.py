"""Epochs read in pieces: what a stopped job read, and who reads the rest (pure numpy).

A job is preempted or requeued part-way through an epoch and resumes, maybe with
another number of ranks. Its state (dlfs.order.sampler.DLFSSampler.state_dict) does
not list the samples it read, which would cost bytes per sample: it names the
*pieces* the epoch ran in so far, each (world size, mode, samples each rank
consumed), and every rank recomputes from them, without talking to the others,
which samples were read and how the rest is dealt out:

- piece 0 is the epoch as planned for its world (plan.random_plan or
  plan.locality_plan): an uninterrupted epoch is a single piece;
- the rest after piece 0 is its unread part in the job's read order (step by
  step, ranks in order), each sample once, less every sample read already;
- the rest after a later piece is the previous rest, less what was read;
- a later piece deals its rest out by DistributedSampler's rules for its own
  world: padded to a multiple of it by repeating the head (cut with drop_last),
  rank r reading pool[r::world] in random mode, or dealt by chunk and node for
  the new nodes in locality mode (plan.locality_deal).

A resume with the world size of the last piece goes on in that piece: the rest
of the epoch in exactly the order the uninterrupted job would have read it. A
locality piece needs its layout again; the state keeps what is not per sample
(the ranks' nodes, each chunk's node) and a digest of the rest (each sample's
chunk), which the resuming mount must report alike.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dlfs.order.plan import Layout, locality_deal, locality_plan, random_plan, shard_sizes


@dataclass(frozen=True)
class Piece:
    """Part of an epoch read by one job: `consumed` samples per rank (ranks in lockstep)."""

    world: int
    consumed: int
    layout: Layout | None = None  # locality mode's inputs; None: random mode
    window: int = 8

    @property
    def mode(self) -> str:
        return "random" if self.layout is None else "locality"


def piece_plans(n: int, seed: int, epoch: int, drop_last: bool,
                pieces: list[Piece]) -> list[np.ndarray]:
    """The plan (world x num_samples) of every piece of an epoch of `n` samples.

    Raises ValueError when a piece claims more samples than its plan holds (a
    state that does not belong to these inputs).
    """
    plans: list[np.ndarray] = []
    read = np.zeros(n, dtype=bool)
    rest = np.zeros(0, dtype=np.int64)
    for k, piece in enumerate(pieces):
        if k == 0:
            plan = (random_plan(n, piece.world, seed, epoch, drop_last) if piece.layout is None
                    else locality_plan(piece.layout, piece.world, seed, epoch, drop_last,
                                       piece.window))
        else:
            plan = deal_rest(rest, piece, drop_last, np.random.default_rng((seed + epoch, k)))
        if not 0 <= piece.consumed <= plan.shape[1]:
            raise ValueError(f"piece {k} of epoch {epoch} says each of its {piece.world} ranks "
                             f"consumed {piece.consumed} samples, but it holds "
                             f"{plan.shape[1]} per rank")
        plans.append(plan)
        if k + 1 < len(pieces):
            if k == 0:
                rest = _first_occurrences(plan[:, piece.consumed:].T.ravel())
            read[plan[:, :piece.consumed].ravel()] = True
            rest = rest[~read[rest]]
    return plans


def deal_rest(rest: np.ndarray, piece: Piece, drop_last: bool,
              rng: np.random.Generator) -> np.ndarray:
    """The samples left in an epoch, dealt to `piece.world` ranks by DistributedSampler's
    rules: padded with the head of `rest` (cut with drop_last) to a multiple of the world,
    then round-robin (random mode, `rest` is in random order already) or by chunk and node."""
    total, num = shard_sizes(len(rest), piece.world, drop_last)
    if num == 0:
        return np.zeros((piece.world, 0), dtype=np.int64)
    pool = np.resize(rest, total)
    if piece.layout is None:
        return np.ascontiguousarray(pool.reshape(num, piece.world).T)
    return locality_deal(piece.layout, pool, num, piece.window, rng)


def resume_pieces(saved: list[Piece], world: int, layout: Layout | None,
                  window: int) -> tuple[list[Piece], int]:
    """(pieces, offset): how a sampler of `world` ranks goes on from `saved`.

    The same world as the last piece: that piece goes on at its consumed count.
    Another world: a new piece over the rest, planned with this sampler's own
    layout (its nodes); a last piece that read nothing is replaced, so a state
    saved at an epoch's start resumes as that epoch planned for the new world.
    """
    pieces = list(saved)
    last = pieces[-1]
    if last.world == world:
        return pieces, last.consumed
    if last.consumed == 0:
        pieces.pop()
    return [*pieces, Piece(world, 0, layout, window)], 0


def with_consumed(pieces: list[Piece], consumed: int) -> list[Piece]:
    """`pieces` with the last one's consumed count replaced."""
    return [*pieces[:-1], replace(pieces[-1], consumed=consumed)]


def _first_occurrences(items: np.ndarray) -> np.ndarray:
    """`items` with each value kept only where it first occurs, in order."""
    _, first = np.unique(items, return_index=True)
    return items[np.sort(first)]


# -- the state's encoding ---------------------------------------------------------------

def layout_digest(sample_chunk: np.ndarray) -> str:
    """Fingerprint of each sample's chunk: the per-sample half of a layout, which the state
    does not carry (the resuming mount must report it alike)."""
    return hashlib.blake2b(np.ascontiguousarray(sample_chunk, dtype="<i8").tobytes(),
                           digest_size=16).hexdigest()


def encode_layout(layout: Layout, window: int) -> dict[str, Any]:
    """A locality piece's layout without its per-sample part: bytes per chunk and rank."""
    used = _used_chunks(layout.sample_chunk)
    nodes = np.asarray(layout.chunk_node, dtype="<i4")[used]
    return {"window": int(window), "rank_nodes": [int(x) for x in layout.rank_nodes],
            "node_count": int(layout.node_count), "chunks": len(layout.chunk_node),
            "chunk_nodes": base64.b64encode(zlib.compress(nodes.tobytes(), 9)).decode(),
            "sample_chunks": layout_digest(layout.sample_chunk)}


def decode_layout(data: dict[str, Any], sample_chunk: np.ndarray | None) -> tuple[Layout, int]:
    """(layout, window) of an encoded locality piece, completed with `sample_chunk` (this
    mount's; ValueError when it is missing or not the one the state was made with)."""
    if sample_chunk is None:
        raise ValueError("the state was saved in locality mode, and this sampler has no chunk "
                         "layout to recompute its order with: read the dataset through a DLFS "
                         "mount of the same store")
    if layout_digest(sample_chunk) != data["sample_chunks"]:
        raise ValueError("the state was saved in locality mode over another chunk layout "
                         "than this mount reports: mount the same store with the same "
                         "datasets to resume")
    used = _used_chunks(sample_chunk)
    nodes = np.frombuffer(zlib.decompress(base64.b64decode(data["chunk_nodes"])), "<i4")
    chunks = int(data["chunks"])
    if len(nodes) != len(used) or (len(used) and used[-1] >= chunks):
        raise ValueError("the state's chunk layout does not fit this mount's chunks")
    chunk_node = np.full(chunks, -1, dtype=np.int64)
    chunk_node[used] = nodes
    rank_nodes = np.asarray(data["rank_nodes"], dtype=np.int64)
    return Layout(np.asarray(sample_chunk, dtype=np.int64), chunk_node, rank_nodes,
                  int(data["node_count"])), int(data["window"])


def _used_chunks(sample_chunk: np.ndarray) -> np.ndarray:
    return np.unique(sample_chunk[sample_chunk >= 0])

"""DLFSSampler: plans each epoch's order, tells the mount, keeps DistributedSampler's contract.

A training job fixes each epoch's order in advance (the sampler's seed); this
sampler computes it, announces this rank's share to the node's DLFS daemon once
per epoch (so the daemon can read ahead of it), and, in locality mode, makes
each rank read mostly chunks its own node holds (docs/ORDER.md). It is a torch
Sampler by protocol (`__iter__`, `__len__`, `set_epoch`) without importing
torch, so it also drives tf.data, DALI file lists (`write_order`) or a plain loop.

    sampler = DLFSSampler(dataset, mode="locality")        # dataset.samples under the mount
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=8)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader: ...
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlfs.mountinfo import find_mount
from dlfs.order.plan import Layout, locality_plan, random_plan, shard_sizes
from dlfs.order.randomness import (
    entropy_figure,
    epoch_relation,
    local_fraction,
    plan_chunk_keys,
    read_steps,
)
from dlfs.order.ranks import (
    block_nodes,
    check_rank_nodes,
    gather,
    resolve_rank_world,
    torch_distributed,
)
from dlfs.order.resume import (
    Piece,
    decode_layout,
    encode_layout,
    piece_plans,
    resume_pieces,
    with_consumed,
)
from dlfs.order.seam import Locality, OrderClient, check_locality

__all__ = ["DLFSSampler", "Locality", "OrderClient", "dataset_paths", "dlfs_mount_of",
           "write_order"]

# Its public name (dlfs.sampler), the logger users configure, as before it moved here.
log = logging.getLogger("dlfs.sampler")

MODES = ("random", "locality")
DLFS_FSTYPE = "fuse.dlfs"  # what the daemon mounts as (dlfs.cli.mountctl.FSTYPE)
PLANS_KEPT = 2  # this epoch's and the last: the epoch-to-epoch figures compare the two
STATE_FORMAT = "dlfs-sampler-state/1"


@dataclass
class _Run:
    """One iteration of an epoch: the pieces it is part of (its own the last), where in
    its piece it starts, this rank's order there, and how many indices it yielded."""

    epoch: int
    pieces: list[Piece]
    offset: int
    mine: np.ndarray  # this rank's whole row of the last piece
    yielded: int = 0
    started: bool = False

    @property
    def rest(self) -> np.ndarray:
        return self.mine[self.offset:]


class DLFSSampler:
    """This rank's share of each epoch, planned alike on every rank (no communication).

    Across all ranks every sample is read exactly once per epoch, padded or cut
    like torch's DistributedSampler (`drop_last`); a new order each epoch, the
    same order for the same seed and epoch. See docs/ORDER.md for the modes.
    """

    def __init__(self, paths_or_dataset: Any, *, mount: str | os.PathLike | None = None,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 mode: str = "random", window: int = 8, drop_last: bool = False,
                 client: OrderClient | None = None,
                 rank_nodes: Sequence[int] | np.ndarray | None = None,
                 batch_size: int = 32) -> None:
        self.paths, n = dataset_paths(paths_or_dataset)
        _check_options(n, mode, window, seed, batch_size)
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.seed, self.window, self.batch_size = int(seed), int(window), int(batch_size)
        self.drop_last = bool(drop_last)
        self.total_size, self.num_samples = shard_sizes(n, self.world_size, self.drop_last)
        self.epoch = 0
        self.randomness: dict[str, Any] | None = None
        self._n = n
        self._plans: dict[int, np.ndarray] = {}
        self._steps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._run: _Run | None = None  # the current epoch's iteration, or a loaded resume
        # id(layout) -> (layout, its state encoding): torchdata asks at every batch
        self._encoded: dict[int, tuple[Layout, dict[str, Any]]] = {}
        self._list_digest: str | None = None
        self._owns_client = client is None
        self.client, why_not = (client, None) if client is not None else self._connect(mount)
        self.locality, why_no_locality = self._fetch_locality()
        self.layout, why_random = (None, None)
        if mode == "locality":
            self.layout, why_random = self._plan_layout(rank_nodes)
        self.mode = "locality" if self.layout is not None else "random"
        self._say_why(mode, mount, why_not or why_no_locality or why_random)

    # -- the torch Sampler protocol -------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        """This rank's indices for the current epoch (the rest of it after
        `load_state_dict`); announced to the mount at the first `next()`.

        Lazy on purpose: torchdata's StatefulDataLoader makes an iterator, then
        loads the state and makes another; only the one it reads is announced.
        """
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        run = self._current_run()
        if run.started:  # a second pass over the same epoch: the whole of it again
            run = self._fresh_run()
        run.started = True
        self._run = run
        rest = run.rest
        self._announce(rest)
        self._measure(self.plan(self.epoch))
        for index in rest.tolist():
            run.yielded += 1  # counted before the caller has it: state_dict() includes it
            yield index

    def __len__(self) -> int:
        """What an iteration of the current epoch yields: num_samples, or after
        `load_state_dict` what is left of the resumed epoch."""
        run = self._run
        if run is not None and run.epoch == self.epoch and (
                not run.started or run.yielded < len(run.rest)):
            return len(run.rest)
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Like DistributedSampler.set_epoch: the order is seeded by seed + epoch.

        A state loaded for this same epoch stays: the usual loop calls
        set_epoch(epoch) after load_state_dict and must get the rest.
        """
        self.epoch = _check_epoch(epoch)

    # -- resuming -------------------------------------------------------------------

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The job's position in its epoch: enough to resume it exactly, on any world size.

        Ranks run in lockstep, so any rank's state describes the job. By default it
        counts the indices this rank's iterator has yielded, which is exact inside
        torchdata's StatefulDataLoader (it asks at the batch its user takes). A plain
        DataLoader's workers run ahead of the training loop: pass `consumed`, the
        samples this rank's loop took from the current iteration (after a resume:
        since the resumed position). Plain Python types (JSON, torch.save).
        """
        run = self._current_run()
        left = len(run.rest)
        if consumed is None:
            consumed = run.yielded if run.started else 0
        elif (isinstance(consumed, bool) or not isinstance(consumed, (int, np.integer))
              or not 0 <= consumed <= left):
            raise ValueError(f"consumed must be an integer in 0..{left} (the samples of this "
                             f"rank's iteration of epoch {self.epoch}), not {consumed!r}")
        pieces = with_consumed(run.pieces, run.offset + int(consumed))
        last = pieces[-1]
        return {
            "format": STATE_FORMAT,
            "seed": self.seed,
            "epoch": run.epoch,
            "drop_last": self.drop_last,
            "samples": self._n,
            "sample_list": self._sample_list_digest(),
            "world_size": last.world,
            "mode": last.mode,
            "consumed": last.consumed,
            "job_consumed": sum(p.world * p.consumed for p in pieces),
            "pieces": [self._encode_piece(p) for p in pieces],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state` (state_dict() of any rank, of a job of any world size).

        The next iteration of its epoch yields this rank's share of the rest: with
        the world size of the saved piece, exactly what the uninterrupted job would
        have read; with another, the rest dealt out anew (docs/ORDER.md). Seed and
        drop_last are the state's. ValueError (one line) for a state of another
        sample list or one that is no sampler state.
        """
        pieces, epoch, seed, drop_last = self._decode_state(state)
        if (seed, drop_last) != (self.seed, self.drop_last):
            log.info("DLFSSampler: the state's seed %d and drop_last %s replace this "
                     "sampler's %d and %s", seed, drop_last, self.seed, self.drop_last)
            self.seed, self.drop_last = seed, drop_last
            self.total_size, self.num_samples = shard_sizes(self._n, self.world_size,
                                                            drop_last)
            self._plans.clear()
            self._steps.clear()
        pieces, offset = resume_pieces(pieces, self.world_size, self.layout, self.window)
        plans = piece_plans(self._n, self.seed, epoch, self.drop_last, pieces)
        self.epoch = epoch
        self._run = _Run(epoch, pieces, offset, plans[-1][self.rank])
        log.info("DLFSSampler: resuming epoch %d at %d of %d samples per rank (%s, %d ranks, "
                 "piece %d)", epoch, offset, plans[-1].shape[1], pieces[-1].mode,
                 self.world_size, len(pieces) - 1)

    def _current_run(self) -> _Run:
        """The current epoch's iteration: started, loaded by load_state_dict, or fresh."""
        run = self._run
        if run is not None and run.epoch == self.epoch:
            return run
        return self._fresh_run()

    def _fresh_run(self) -> _Run:
        return _Run(self.epoch, [Piece(self.world_size, 0, self.layout, self.window)], 0,
                    self.plan(self.epoch)[self.rank])

    def _decode_state(self, state: Mapping[str, Any]) -> tuple[list[Piece], int, int, bool]:
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a DLFSSampler state (no format {STATE_FORMAT!r}): pass "
                             "what DLFSSampler.state_dict() returned")
        try:
            n, digest = int(state["samples"]), str(state["sample_list"])
            if n != self._n or digest != self._sample_list_digest():
                raise ValueError(
                    f"the state was saved for another sample list ({n} samples, digest "
                    f"{digest[:12]}), this sampler has {self._n} (digest "
                    f"{self._sample_list_digest()[:12]}): resume with the same dataset, "
                    "the same files in the same order")
            epoch, seed = _check_epoch(state["epoch"]), int(state["seed"])
            pieces = [self._decode_piece(p) for p in state["pieces"]]
            if not pieces:
                raise ValueError("the state names no piece of its epoch")
            return pieces, epoch, seed, bool(state["drop_last"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"a DLFSSampler state without a valid {err}: pass what "
                             "DLFSSampler.state_dict() returned") from None

    def _encode_piece(self, piece: Piece) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": piece.world, "mode": piece.mode,
                               "consumed": piece.consumed}
        if piece.layout is not None:
            cached = self._encoded.get(id(piece.layout))
            if cached is None or cached[0] is not piece.layout:
                cached = (piece.layout, encode_layout(piece.layout, piece.window))
                self._encoded[id(piece.layout)] = cached
            out["layout"] = cached[1]
        return out

    def _decode_piece(self, data: Mapping[str, Any]) -> Piece:
        world, consumed = int(data["world_size"]), int(data["consumed"])
        if world < 1 or consumed < 0:
            raise ValueError(f"a piece of the state has world_size {world} and consumed "
                             f"{consumed}")
        if data.get("layout") is None:
            return Piece(world, consumed)
        layout, window = decode_layout(
            data["layout"], None if self.locality is None else self.locality.sample_chunk)
        if len(layout.rank_nodes) != world:
            raise ValueError(f"a locality piece of the state has {len(layout.rank_nodes)} "
                             f"rank nodes for {world} ranks")
        self._encoded[id(layout)] = (layout, dict(data["layout"]))
        return Piece(world, consumed, layout, window)

    def _sample_list_digest(self) -> str:
        """Digest of the sample list, wherever it is mounted: the paths relative to their
        common directory (another node's mountpoint gives the same), or the count."""
        if self._list_digest is None:
            h = hashlib.blake2b(digest_size=16)
            if self.paths is None:
                h.update(f"sized:{self._n}".encode())
            else:
                root = _common_dir(self.paths)
                h.update(b"\n".join(os.fsencode(p[len(root):]) for p in self.paths))
            self._list_digest = h.hexdigest()
        return self._list_digest

    # -- plans ----------------------------------------------------------------------

    def plan(self, epoch: int | None = None) -> np.ndarray:
        """The whole job's order for `epoch` (default: the current one), world x num_samples.

        Row r is rank r's order; every rank computes the same array. Read-only.
        """
        epoch = self.epoch if epoch is None else _check_epoch(epoch)
        if epoch not in self._plans:
            if self.layout is not None:
                plan = locality_plan(self.layout, self.world_size, self.seed, epoch,
                                     self.drop_last, self.window)
            else:
                plan = random_plan(self._n, self.world_size, self.seed, epoch, self.drop_last)
            plan.flags.writeable = False
            self._plans[epoch] = plan
            _keep_newest(self._plans)
        return self._plans[epoch]

    def order(self, epoch: int | None = None) -> np.ndarray:
        """This rank's indices for `epoch`, in read order, without announcing them: what
        the next iteration yields (after `load_state_dict`, the rest of the resumed epoch)."""
        epoch = self.epoch if epoch is None else _check_epoch(epoch)
        run = self._run
        if run is not None and run.epoch == epoch and not run.started:
            return run.rest
        return self.plan(epoch)[self.rank]

    # -- the mount ------------------------------------------------------------------

    def close(self) -> None:
        """Close the client this sampler connected (one passed in stays the caller's)."""
        if self.client is not None and self._owns_client:
            self.client.close()
        self.client = None

    def __enter__(self) -> DLFSSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DLFSSampler({self._n} samples, mode={self.mode}, rank {self.rank} of "
                f"{self.world_size}, {self.num_samples} per rank, seed={self.seed}, "
                f"epoch={self.epoch}, client={'yes' if self.client else 'no'})")

    def _connect(self, mount: str | os.PathLike | None) -> tuple[OrderClient | None, str | None]:
        """The mount's order client, or None and why not."""
        if self.paths is None:
            return None, "the dataset has no paths (a plain Sized: no .samples, .imgs or .files)"
        target = os.fspath(mount) if mount is not None else dlfs_mount_of(self.paths[0])
        if target is None:
            return None, f"{self.paths[0]} is not inside a DLFS mount"
        from dlfs.order.client import connect

        try:
            client = connect(self.paths, mount=target)
        except (OSError, RuntimeError, ValueError) as e:
            return None, f"the mount {target} refused the sampler: {e}"
        if client is None:
            return None, f"the daemon of {target} takes no order announcements"
        return client, None

    def _fetch_locality(self) -> tuple[Locality | None, str | None]:
        """Where the samples live, checked once; None and why when it is not usable."""
        if self.client is None:
            return None, None
        try:
            loc = self.client.locality()
        except (OSError, RuntimeError) as e:
            return None, f"the mount did not say where the samples live: {e}"
        problem = check_locality(loc, self._n)
        if problem is not None:
            return None, f"the mount's locality is unusable: {problem}"
        return Locality(np.asarray(loc.sample_chunk, dtype=np.int64),
                        np.asarray(loc.chunk_node, dtype=np.int64),
                        int(loc.node_count), int(loc.node)), None

    def _plan_layout(self, rank_nodes: Sequence[int] | np.ndarray | None
                     ) -> tuple[Layout | None, str | None]:
        """The locality plan's inputs, or None and why the plan stays random.

        Under torch.distributed every rank takes part in one all_gather, whether
        or not it has locality itself: a rank that skipped it would hang the rest,
        and the gathered answer lets all ranks fall back together.
        """
        loc = self.locality
        if rank_nodes is not None:
            if loc is None:
                return None, None
            return self._layout(check_rank_nodes(rank_nodes, self.world_size,
                                                 loc.node_count)), None
        dist = torch_distributed()
        if dist is not None and dist.get_world_size() == self.world_size:
            mine = None if loc is None else (loc.node, _digest(loc))
            everyone = gather(dist, mine, self.world_size)
            if any(item is None for item in everyone):
                return None, "some ranks have no locality from their mount"
            if len({digest for _, digest in everyone}) > 1:
                return None, "the ranks' mounts report different chunk layouts"
            return self._layout(np.array([node for node, _ in everyone], dtype=np.int64)), None
        if loc is None:
            return None, None
        nodes = block_nodes(self.world_size, loc.node_count)
        if nodes[self.rank] != loc.node:
            log.warning("DLFSSampler: assuming ranks fill nodes in blocks of %d, rank %d on "
                        "node %d, but its mount says node %d; pass rank_nodes= (or initialise "
                        "torch.distributed) for the real map", max(1, self.world_size //
                        loc.node_count), self.rank, nodes[self.rank], loc.node)
        return self._layout(nodes), None

    def _layout(self, rank_nodes: np.ndarray) -> Layout:
        assert self.locality is not None
        return Layout(self.locality.sample_chunk, self.locality.chunk_node, rank_nodes,
                      self.locality.node_count)

    def _say_why(self, mode: str, mount: object, why: str | None) -> None:
        """One warning when the sampler cannot do what was asked, info otherwise.

        Asked: locality mode, or a mount named. A plain random sampler over files
        outside DLFS is a legitimate use and only gets an info line.
        """
        if why is None:
            return
        then = ("as a plain sampler (no read-ahead)" if self.client is None
                else "(the mount still reads ahead)")
        if mode == "locality" and self.layout is None:
            log.warning("DLFSSampler: %s; sampling in random order %s", why, then)
        elif mount is not None and self.client is None:
            log.warning("DLFSSampler: %s; sampling %s", why, then)
        elif self.client is None:
            log.info("DLFSSampler: %s; sampling %s", why, then)
        else:
            log.info("DLFSSampler: %s; the randomness figures leave out the chunk mix", why)

    def _announce(self, mine: np.ndarray) -> None:
        """Once per epoch; the epoch goes on without read-ahead if the mount refuses."""
        if self.client is None:
            return
        try:
            self.client.announce(self.epoch, mine)
        except (OSError, RuntimeError) as e:
            log.warning("DLFSSampler: announcing epoch %d to the mount failed (%s); the "
                        "epoch goes on without read-ahead", self.epoch, e)

    # -- randomness -----------------------------------------------------------------

    def _measure(self, plan: np.ndarray) -> None:
        """`randomness` for this epoch, logged once (docs/ORDER.md defines the figures)."""
        if self.randomness is not None and self.randomness["epoch"] == self.epoch:
            return
        loc = self.locality
        steps = self._read_steps(self.epoch)
        correlation, same_rank = (epoch_relation(steps, self._read_steps(self.epoch - 1))
                                  if self.epoch > 0 else (None, None))
        node = self.layout.rank_nodes[self.rank] if self.layout is not None else None
        self.randomness = {
            "epoch": self.epoch,
            "mode": self.mode,
            "batch_size": self.batch_size,
            "entropy": None if loc is None else entropy_figure(
                plan_chunk_keys(plan, loc.sample_chunk), self.batch_size),
            "epoch_correlation": correlation,
            "same_rank": same_rank,
            "local_fraction": None if loc is None else local_fraction(
                plan[self.rank], loc.sample_chunk, loc.chunk_node,
                loc.node if node is None else int(node)),
        }
        log.info("DLFSSampler epoch %d (%s, rank %d of %d): %s", self.epoch, self.mode,
                 self.rank, self.world_size, describe_randomness(self.randomness,
                                                                 self.world_size))

    def _read_steps(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._steps:
            self._steps[epoch] = read_steps(self.plan(epoch), self._n)
            _keep_newest(self._steps)
        return self._steps[epoch]


def describe_randomness(r: dict[str, Any], world: int) -> str:
    """The figures as one log line."""
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"
    return (f"randomness {fmt(r['entropy'])} (chunk mix per batch of {r['batch_size']} vs a "
            f"uniform shuffle), correlation with the last epoch {fmt(r['epoch_correlation'])}, "
            f"same rank as last epoch {fmt(r['same_rank'])} (random: {1 / world:.3f}), "
            f"read from own node {fmt(r['local_fraction'])}")


def dataset_paths(obj: Any) -> tuple[list[str] | None, int]:
    """(paths or None, sample count) of a list of paths or a dataset object.

    Datasets: torchvision's ImageFolder/DatasetFolder (`.samples` or `.imgs`:
    (path, class) pairs), anything with `.files`, torch's Subset of one of those
    (`.dataset` and `.indices`), or any Sized (paths unknown).
    """
    if isinstance(obj, (str, bytes, os.PathLike)):
        raise ValueError(f"pass a list of paths or a dataset, not one path ({obj!r})")
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [os.fsdecode(p) for p in obj], len(obj)
    for attr in ("samples", "imgs", "files"):
        items = getattr(obj, attr, None)
        if items is not None:
            paths = [os.fsdecode(item if isinstance(item, (str, bytes, os.PathLike))
                                 else item[0]) for item in items]
            return paths, len(paths)
    if hasattr(obj, "dataset") and hasattr(obj, "indices"):  # a train/validation split
        inner, _ = dataset_paths(obj.dataset)
        if inner is not None:
            return [inner[i] for i in obj.indices], len(obj.indices)
    if hasattr(obj, "__len__"):
        return None, len(obj)
    raise ValueError(f"cannot sample {type(obj).__name__}: it has no length (pass a list of "
                     "paths or a dataset with __len__)")


def dlfs_mount_of(path: str | os.PathLike) -> str | None:
    """The DLFS mountpoint `path` lies in, or None; reads mountinfo, never the mount.

    The nearest enclosing mountpoint decides (a DLFS mount has no mounts inside).
    Paths are made absolute but symlinks are not followed: resolving them would
    touch the mount, which hangs if its daemon does.
    """
    here = os.path.abspath(os.fspath(path))
    while True:
        entry = find_mount(here)
        if entry is not None:
            return here if entry.fstype == DLFS_FSTYPE else None
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def write_order(sampler: DLFSSampler, path: str | os.PathLike, epoch: int | None = None) -> int:
    """Write this rank's order for `epoch` as a file list, one path per line (DALI, tf.data).

    Written to a temporary file and renamed, so a reader never sees half a list.
    Returns the number of lines. Announces nothing: the reader is another program.
    """
    if sampler.paths is None:
        raise ValueError("the sampler's dataset has no paths: nothing to write")
    paths = sampler.paths
    lines = [os.fsencode(paths[i]) for i in sampler.order(epoch).tolist()]
    bad = next((p for p in lines if b"\n" in p), None)
    if bad is not None:
        raise ValueError(f"a path holds a newline, which a file list cannot: {bad!r}")
    target = os.fspath(path)
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(b"".join(p + b"\n" for p in lines))
    os.replace(tmp, target)
    return len(lines)


def _check_options(n: int, mode: str, window: int, seed: int, batch_size: int) -> None:
    if n == 0:
        raise ValueError("the dataset is empty: nothing to sample")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    for name, value, low in (("window", window, 1), ("seed", seed, 0),
                             ("batch_size", batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")


def _check_epoch(epoch: object) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, not {epoch!r}")
    return int(epoch)


def _common_dir(paths: list[str]) -> str:
    """The longest common directory prefix of `paths`, with its trailing slash ('' if none).

    The smallest and largest path bound every other one's common prefix: O(n).
    """
    low, high = min(paths), max(paths)
    size = 0
    for a, b in zip(low, high, strict=False):
        if a != b:
            break
        size += 1
    return low[:low.rfind("/", 0, size) + 1]


def _digest(loc: Locality) -> str:
    """Fingerprint of the chunk layout, to check that every rank plans with the same one."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.int64(loc.node_count).tobytes())
    h.update(np.ascontiguousarray(loc.sample_chunk, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(loc.chunk_node, dtype=np.int64).tobytes())
    return h.hexdigest()


def _keep_newest(cache: dict[int, Any]) -> None:
    """Drop all but the PLANS_KEPT most recently added epochs."""
    while len(cache) > PLANS_KEPT:
        del cache[next(iter(cache))]

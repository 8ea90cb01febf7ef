"""Which rank this is, of how many, and which node each rank runs on.

Sources, first that answers: explicit arguments; torch.distributed when its
process group is initialised; RANK/WORLD_SIZE (torchrun, most launchers);
SLURM_PROCID/SLURM_NTASKS (srun); else rank 0 of 1. torch is never imported
here: a process group cannot be initialised without torch already imported,
so a program that has not imported it pays nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ENV_PAIRS = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))


def torch_distributed() -> Any | None:
    """torch.distributed if torch is imported and its process group initialised."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def resolve_rank_world(rank: int | None, world_size: int | None,
                       env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world_size): the arguments where given, else the first source that knows."""
    found_rank, found_world, source = _discover(os.environ if env is None else env)
    world = _check_int("world_size", world_size if world_size is not None else found_world,
                       "argument" if world_size is not None else source)
    rank_ = _check_int("rank", rank if rank is not None else found_rank,
                       "argument" if rank is not None else source)
    if world < 1:
        raise ValueError(f"world_size must be at least 1, not {world}")
    if not 0 <= rank_ < world:
        raise ValueError(f"rank {rank_} is not in 0..{world - 1} (world_size {world}; "
                         f"from {source if rank is None or world_size is None else 'arguments'})")
    return rank_, world


def _discover(env: Mapping[str, str]) -> tuple[Any, Any, str]:
    dist = torch_distributed()
    if dist is not None:
        return dist.get_rank(), dist.get_world_size(), "torch.distributed"
    for rank_var, world_var in ENV_PAIRS:
        if rank_var in env and world_var in env:  # half a pair (an sbatch script) is no answer
            return env[rank_var], env[world_var], f"{rank_var}/{world_var}"
    return 0, 1, "default (no torch.distributed, RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS)"


def _check_int(name: str, value: Any, source: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {value!r} (from {source})")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, not {value!r} (from {source})") from None


def check_rank_nodes(rank_nodes: Sequence[int] | np.ndarray, world: int,
                     node_count: int) -> np.ndarray:
    """An explicit rank -> node list, checked against the world and the node count."""
    nodes = np.asarray(rank_nodes)
    if nodes.ndim != 1 or len(nodes) != world:
        raise ValueError(f"rank_nodes needs one node index per rank ({world}), "
                         f"got shape {nodes.shape}")
    if len(nodes) and not np.issubdtype(nodes.dtype, np.integer):
        raise ValueError(f"rank_nodes must be integers, not {nodes.dtype}")
    if len(nodes) and (nodes.min() < 0 or nodes.max() >= node_count):
        raise ValueError(f"rank_nodes values must lie in 0..{node_count - 1} "
                         f"(the mount reports {node_count} nodes)")
    return nodes.astype(np.int64)


def block_nodes(world: int, node_count: int) -> np.ndarray:
    """The usual launcher placement: consecutive ranks fill a node, then the next."""
    per_node = max(1, world // node_count)
    return np.minimum(np.arange(world) // per_node, node_count - 1).astype(np.int64)


def gather(dist: Any, item: Any, world: int) -> list[Any]:
    """One all_gather_object: every rank's `item`, in rank order."""
    out: list[Any] = [None] * world
    dist.all_gather_object(out, item)
    return out

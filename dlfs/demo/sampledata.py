"""Synthetic training datasets for the demo, the tests and the benchmarks.

Shaped like the workloads DLFS is for: class directories of lognormally sized
samples (ImageNet: ~110 KiB JPEGs; BERT: ~2.5 KB records). Contents are
slices of a random pool at random offsets, so every file differs and a
misplaced byte is caught by a checksum comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

POOL_SIZE = 64 << 20


@dataclass(frozen=True)
class TreeSummary:
    files: int
    bytes: int
    paths: list[Path]


def lognormal_sizes(n: int, mean: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """n sizes with the given mean (at least 1), lognormally spread (at least 1 byte)."""
    if mean < 1:
        raise ValueError(f"mean sample size must be at least 1 byte, got {mean}")
    mu = math.log(mean) - sigma * sigma / 2
    return np.maximum(1, rng.lognormal(mu, sigma, n)).astype(np.int64)


def generate_tree(root: Path, files: int, mean_size: int, sigma: float = 0.5,
                  files_per_dir: int = 1000, seed: int = 0) -> TreeSummary:
    """Write `files` samples under root/train/cNNNNN/sample_NNNNNNN.bin."""
    rng = np.random.default_rng(seed)
    sizes = lognormal_sizes(files, mean_size, sigma, rng)
    largest = int(sizes.max(initial=1))
    pool = rng.bytes(max(largest, min(POOL_SIZE, max(1 << 20, largest * 2))))  # fits any
    starts = rng.integers(0, len(pool) - sizes + 1)
    paths = []
    for i, (size, start) in enumerate(zip(sizes.tolist(), starts.tolist(), strict=True)):
        directory = root / "train" / f"c{i // files_per_dir:05d}"
        if i % files_per_dir == 0:
            directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"sample_{i:07d}.bin"
        with open(path, "wb") as f:
            f.write(pool[start : start + size])
        paths.append(path)
    return TreeSummary(files, int(sizes.sum()), paths)


def generate_large_files(root: Path, count: int, size: int, seed: int = 0) -> TreeSummary:
    """`count` files of `size` bytes (Unet3D-like volumes)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    block = rng.bytes(8 << 20)
    paths = []
    for i in range(count):
        path = root / f"volume_{i:03d}.npy"
        with open(path, "wb") as f:
            left = size
            salt = i.to_bytes(8, "little")
            while left > 0:
                piece = block[: min(left, len(block) - 8)] + salt
                f.write(piece[:left])
                left -= min(left, len(piece))
        paths.append(path)
    return TreeSummary(count, count * size, paths)

"""A training-loop reader: one shuffled epoch over a file list, N worker processes.

This is what a PyTorch DataLoader with N workers does to a file system (open,
read whole sample, close, in random order), without needing PyTorch. The demo
and the benchmarks measure the mount with it, and the same reads of the source
directory are the baseline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class EpochResult:
    files: int
    bytes: int
    seconds: float

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds if self.seconds else 0.0

    @property
    def mib_per_s(self) -> float:
        return self.bytes / (1 << 20) / self.seconds if self.seconds else 0.0


def _worker_init() -> None:
    # Readers die quietly when the pool ends, whatever handler the parent installed.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _read_all(paths: list[str]) -> int:
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while True:
                data = os.read(fd, 1 << 20)
                if not data:
                    break
                total += len(data)
        finally:
            os.close(fd)
    return total


def shuffled_epoch(paths: list[str], workers: int = 2, seed: int = 0) -> EpochResult:
    """Read every path once, in a seeded random order, split across worker processes."""
    order = list(paths)
    random.Random(seed).shuffle(order)
    return ordered_epoch(order, workers)


def ordered_epoch(order: list[str], workers: int = 2) -> EpochResult:
    """Read the paths in `order` (a sampler's), worker w taking every workers-th one from
    position w: how a DataLoader's workers share a sampler's order."""
    shards = [order[i::workers] for i in range(workers)]
    ctx = mp.get_context("fork")
    # ProcessPoolExecutor, not Pool: a reader that dies raises instead of hanging.
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
        list(pool.map(time.sleep, [0.05] * workers))  # start the workers before the clock
        started = time.perf_counter()
        nbytes = sum(pool.map(_read_all, shards))
        seconds = time.perf_counter() - started
    return EpochResult(len(order), nbytes, seconds)

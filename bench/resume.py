"""Resuming an epoch mid-way: how soon the first batch comes, and whether the
look-ahead still runs ahead of the readers.

One dataset of ~110 KiB samples, one node, the store throttled to
--store-bandwidth per read stream (the daemon's benchmark-only flag). The job
stopped half-way through epoch 1 with 4 ranks; its state (DLFSSampler.state_dict,
saved as JSON) resumes on 2 ranks, this benchmark measures rank 0. Per round,
each on a fresh mount with dropped caches:

  first batch   a new Python process from its start (python -c) until it has read
                the first batch of --batch samples: `fresh` makes a sampler and
                starts epoch 1; `resumed` makes one and loads the state (the rest
                is re-striped over 2 ranks) before it starts
  hit rate      epoch 1 read by --workers processes in the sampler's order, the
                look-ahead's hits / (hits + misses) from `.dlfs/stats.json`:
                `uninterrupted` the whole epoch; `resumed` the rest after
                load_state_dict (only the rest is announced); `naive` the rest
                read while the whole epoch is announced, as a sampler without a
                resume position would announce it (the reference for what item 3
                of issue 34 buys)

It also times load_state_dict alone for an ImageNet-sized list (1.28 M samples,
random and locality mode, 4 -> 2 ranks), where recomputing the pieces costs most.

examples (from the repository root, as root):
  .venv/bin/python bench/resume.py --quick
  .venv/bin/python bench/resume.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _common import (
    Target,
    add_common_args,
    drop_caches,
    formatter,
    mounted,
    populate,
    print_targets,
    run_main,
    size_arg,
    workdir,
)

from dlfs.demo.sampledata import generate_tree
from dlfs.demo.workload import ordered_epoch
from dlfs.order.client import connect
from dlfs.order.sampler import DLFSSampler, Locality

SEED, EPOCH, WORLD_BEFORE, WORLD_AFTER = 7, 1, 4, 2

FIRST_BATCH = r"""
import json, sys
from dlfs.order.sampler import DLFSSampler
listing, state, batch, world, seed, epoch = sys.argv[1:3] + [int(a) for a in sys.argv[3:]]
paths = open(listing).read().splitlines()
sampler = DLFSSampler(paths, rank=0, world_size=world, seed=seed)
if state != "-":
    sampler.load_state_dict(json.load(open(state)))
sampler.set_epoch(epoch)
it = iter(sampler)
for _ in range(batch):
    with open(paths[next(it)], "rb") as f:
        f.read()
print("first batch", flush=True)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p, rounds=5)
    p.add_argument("--files", type=int, default=1500, help="files (default 1500; --quick 300)")
    p.add_argument("--workers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--batch", type=int, default=32, help="samples in the first batch")
    p.add_argument("--store-bandwidth", type=size_arg, default=50 << 20,
                   help="per-stream store rate (default 50M)")
    p.add_argument("--chunk-size", default="16M", help="populate --chunk-size (default 16M)")
    args = p.parse_args(argv)
    if args.quick:
        args.files = max(200, args.files // 5)
    return args


def lookahead_counts(mp: Path) -> tuple[int, int]:
    """(hits, misses) now; read by a new process (a process's own snapshot is reused)."""
    out = subprocess.run(["cat", str(mp / ".dlfs" / "stats.json")], capture_output=True,
                         check=True, timeout=30).stdout
    taken = json.loads(out)["mount"]["lookahead"]
    return int(taken["hits"]), int(taken["misses"])


def first_batch(work: Path, args, listing: Path, state: Path | None) -> float:
    """Seconds from a new process's start to its first batch read through the mount."""
    throttle = ["--store-bandwidth", str(args.store_bandwidth)]
    drop_caches()
    with mounted(work / "store", work / "mnt", throttle, work / "dlfsd.log"):
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", FIRST_BATCH, str(listing),
                               "-" if state is None else str(state), str(args.batch),
                               str(WORLD_AFTER), str(SEED), str(EPOCH)],
                              capture_output=True, text=True, timeout=300)
        took = time.perf_counter() - started
    if proc.returncode != 0 or "first batch" not in proc.stdout:
        raise RuntimeError(f"first-batch process failed: {proc.stderr.strip()[-500:]}")
    return took


def hit_rate(work: Path, args, paths: list[str], state: dict | None, naive: bool) -> float:
    """The look-ahead's hit rate over what this rank reads of epoch 1 on a fresh mount."""
    throttle = ["--store-bandwidth", str(args.store_bandwidth)]
    drop_caches()
    with mounted(work / "store", work / "mnt", throttle, work / "dlfsd.log") as mp:
        here = [str(mp / "ds" / p) for p in paths]
        sampler = DLFSSampler(here, rank=0, world_size=WORLD_AFTER, seed=SEED)
        if state is not None:
            sampler.load_state_dict(state)
        sampler.set_epoch(EPOCH)
        if naive:  # the whole epoch announced, the rest read
            fresh = DLFSSampler(here, rank=0, world_size=WORLD_AFTER, seed=SEED)
            connect(here).announce(EPOCH, fresh.order(EPOCH))
            order = sampler.order().tolist()
        else:
            order = list(sampler)  # announces what it yields
        result = ordered_epoch([here[i] for i in order], args.workers)
        if result.files != len(order):
            raise RuntimeError(f"read {result.files} files, expected {len(order)}")
        hits, misses = lookahead_counts(mp)
    return hits / max(1, hits + misses)


def load_cost(mode: str) -> float:
    """Seconds load_state_dict takes for 1.28 M samples, 4 ranks stopped half-way, 2 go on."""
    n = 1_281_167
    sample_chunk = np.arange(n, dtype=np.int64) // 600  # ~64 MiB chunks of ImageNet
    chunks = int(sample_chunk[-1]) + 1

    def sampler(world: int, node: int) -> DLFSSampler:
        loc = Locality(sample_chunk, (np.arange(chunks) % 2).astype(np.int32), 2, node)
        return DLFSSampler(range(n), rank=0, world_size=world, seed=SEED, mode=mode,
                           client=_Given(loc))

    before = sampler(WORLD_BEFORE, 0)
    before.set_epoch(EPOCH)
    state = json.loads(json.dumps(before.state_dict(consumed=len(before) // 2)))
    after = sampler(WORLD_AFTER, 0)
    started = time.perf_counter()
    after.load_state_dict(state)
    return time.perf_counter() - started


class _Given:
    """An order client that reports a given locality (no mount needed for the cost)."""

    def __init__(self, loc: Locality) -> None:
        self.loc = loc

    def locality(self) -> Locality:
        return self.loc

    def announce(self, epoch: int, order: np.ndarray) -> None:
        pass

    def close(self) -> None:
        pass


def spread(values: list[float]) -> str:
    return (f"min {min(values):.3f} median {statistics.median(values):.3f} "
            f"max {max(values):.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with workdir(args.workdir, args.keep, "dlfs-resume-") as work:
        summary = generate_tree(work / "src", args.files, 110 * 1024)
        populate(work / "src", work / "store", "ds", ["--chunk-size", args.chunk_size])
        rel = sorted(str(p.relative_to(work / "src")) for p in (work / "src").rglob("*")
                     if p.is_file())
        listing = work / "paths.txt"
        listing.write_text("".join(f"{work / 'mnt' / 'ds' / r}\n" for r in rel))
        stopped = DLFSSampler([str(work / "mnt" / "ds" / r) for r in rel], rank=0,
                              world_size=WORLD_BEFORE, seed=SEED)
        stopped.set_epoch(EPOCH)
        state = stopped.state_dict(consumed=len(stopped) // 2)
        state_file = work / "state.json"
        state_file.write_text(json.dumps(state))
        print(f"{len(rel)} files, {summary.bytes / (1 << 20):.0f} MiB; store "
              f"{args.store_bandwidth / (1 << 20):.0f} MiB/s per stream; epoch {EPOCH} "
              f"stopped at {state['job_consumed']} samples by {WORLD_BEFORE} ranks, resumed "
              f"on {WORLD_AFTER}; state {len(state_file.read_bytes())} bytes")
        starts, rates = [], []
        for r in range(args.rounds):
            pair = {}
            for resumed in (False, True) if r % 2 else (True, False):
                pair[resumed] = first_batch(work, args, listing, state_file if resumed else None)
            starts.append(pair[True] / pair[False])
            rate = {name: hit_rate(work, args, rel, state if name != "uninterrupted" else None,
                                   name == "naive")
                    for name in ("uninterrupted", "resumed", "naive")}
            rates.append(rate)
            print(f"  round {r}: first batch fresh {pair[False]:.3f} s, resumed "
                  f"{pair[True]:.3f} s ({starts[-1]:.3f}); hit rate uninterrupted "
                  f"{rate['uninterrupted']:.3f}, resumed {rate['resumed']:.3f}, naive "
                  f"{rate['naive']:.3f}", flush=True)
        relative = [x["resumed"] / x["uninterrupted"] for x in rates]
        print(f"first batch, resumed / fresh: {spread(starts)}")
        print(f"hit rate uninterrupted: {spread([x['uninterrupted'] for x in rates])}")
        print(f"hit rate resumed:       {spread([x['resumed'] for x in rates])}")
        print(f"hit rate naive:         {spread([x['naive'] for x in rates])}")
        print(f"hit rate resumed / uninterrupted: {spread(relative)}")
    for mode in ("random", "locality"):
        costs = [load_cost(mode) for _ in range(3)]
        print(f"load_state_dict, 1.28 M samples, {mode}, {WORLD_BEFORE} -> {WORLD_AFTER} "
              f"ranks: {spread(costs)} s")
    print_targets([Target("hit rate resumed / uninterrupted", statistics.median(relative),
                          ">=", 0.9)], args.quick)
    return 0


if __name__ == "__main__":
    os.environ.pop("RANK", None)
    run_main(main)

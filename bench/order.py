"""The announced order: an epoch read with the daemon's look-ahead vs without it.

One dataset of ~110 KiB samples, one node, the store throttled to
--store-bandwidth per read stream (a parallel file system gives each stream
a bounded rate; the aggregate grows with streams), through the daemon's
benchmark-only `--store-bandwidth` flag. The reader is a DataLoader-like
epoch (dlfs.workload.shuffled_epoch: N processes, each its share of one
seeded shuffle). Per round, each on a fresh mount with dropped caches:

  plain      the epoch, nothing announced (what every job got before)
  announced  the same order announced first (dlfs.orderclient: what
             DLFSSampler does at the start of each epoch), then the epoch;
             the announcement's own time is part of the epoch's
  warm       unthrottled, after one epoch filled the page cache: the next
             epoch plain vs announced, alternating, same mount

Targets (issue #24):
  epoch 1 announced / plain (throttled store, single node)   <= 0.5
  warm epoch plain / announced                                >= 0.97

examples (from the repository root, as root):
  .venv/bin/python bench/order.py --quick
  .venv/bin/python bench/order.py --files 4000 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

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

from dlfs.orderclient import connect
from dlfs.sampledata import generate_tree
from dlfs.workload import shuffled_epoch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--files", type=int, default=3000, help="files (default 3000; --quick 600)")
    p.add_argument("--workers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--store-bandwidth", type=size_arg, default=50 << 20,
                   help="per-stream store rate (default 50M)")
    p.add_argument("--chunk-size", default="16M", help="populate --chunk-size (default 16M)")
    p.add_argument("--mount-args", default="", help="extra `dlfs mount` arguments")
    args = p.parse_args(argv)
    if args.quick:
        args.files = max(200, args.files // 5)
    return args


def shuffle(count: int, seed: int) -> list[int]:
    """The permutation shuffled_epoch applies for `seed` (same Random, same list length)."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order


def epoch(mp: Path, rel: list[str], workers: int, seed: int, announce: bool) -> float:
    paths = [str(mp / "ds" / p) for p in rel]
    started = time.perf_counter()
    if announce:
        client = connect(paths)  # the sampler registers once, before its first epoch
        started = time.perf_counter()
        client.announce(seed, shuffle(len(paths), seed))
    r = shuffled_epoch(paths, workers, seed=seed)
    if r.files != len(paths):
        raise RuntimeError(f"read {r.files} files, expected {len(paths)}")
    return time.perf_counter() - started


def one_round(work: Path, args, rel: list[str], seed: int) -> tuple[float, float]:
    throttle = ["--store-bandwidth", str(args.store_bandwidth), *args.mount_args.split()]
    times = {}
    for announce in (False, True) if seed % 2 else (True, False):
        drop_caches()
        with mounted(work / "store", work / "mnt", throttle, work / "dlfsd.log") as mp:
            times[announce] = epoch(mp, rel, args.workers, seed, announce)
    print(f"  round {seed}: plain {times[False]:6.2f} s, announced {times[True]:6.2f} s, "
          f"ratio {times[True] / times[False]:.3f}", flush=True)
    return times[False], times[True]


def warm(work: Path, args, rel: list[str], rounds: int) -> list[float]:
    ratios = []
    with mounted(work / "store", work / "mnt", args.mount_args.split(),
                 work / "dlfsd.log") as mp:
        epoch(mp, rel, args.workers, 100, False)  # fill the page cache
        for r in range(rounds):
            plain = announced = 0.0
            for announce in (False, True) if r % 2 else (True, False):
                t = epoch(mp, rel, args.workers, 200 + r, announce)
                plain, announced = (plain, t) if announce else (t, announced)
            ratios.append(plain / announced)
            print(f"  warm round {r}: plain {plain:6.3f} s, announced {announced:6.3f} s, "
                  f"plain/announced {ratios[-1]:.3f}", flush=True)
    return ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with workdir(args.workdir, args.keep, "dlfs-order-") as work:
        summary = generate_tree(work / "src", args.files, 110 * 1024)
        populate(work / "src", work / "store", "ds", ["--chunk-size", args.chunk_size])
        rel = sorted(str(p.relative_to(work / "src")) for p in (work / "src").rglob("*")
                     if p.is_file())
        print(f"{len(rel)} files, {summary.bytes / (1 << 20):.0f} MiB; store "
              f"{args.store_bandwidth / (1 << 20):.0f} MiB/s per stream; {args.workers} "
              f"reader processes")
        print("epoch 1, throttled store, fresh mount and dropped caches each:")
        pairs = [one_round(work, args, rel, seed) for seed in range(1, args.rounds + 1)]
        ratios = [a / p for p, a in pairs]
        print(f"  announced / plain: min {min(ratios):.3f} median "
              f"{statistics.median(ratios):.3f} max {max(ratios):.3f}")
        print("warm epochs, unthrottled store, one mount:")
        warm_ratios = warm(work, args, rel, args.rounds)
        print(f"  plain / announced: min {min(warm_ratios):.3f} median "
              f"{statistics.median(warm_ratios):.3f} max {max(warm_ratios):.3f}")
    print_targets([Target("epoch 1 announced / plain", statistics.median(ratios), "<=", 0.5),
                   Target("warm epoch plain / announced", statistics.median(warm_ratios),
                          ">=", 0.97)], args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

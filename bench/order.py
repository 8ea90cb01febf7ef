"""The announced order: an epoch read with the daemon's look-ahead vs without it.

One dataset of ~110 KiB samples, one node, the store throttled to
--store-bandwidth per read stream (a parallel file system gives each stream
a bounded rate; the aggregate grows with streams), through the daemon's
benchmark-only `--store-bandwidth` flag. The reader is a DataLoader-like
epoch (dlfs.demo.workload.shuffled_epoch: N processes, each its share of one
seeded shuffle). Per round, each on a fresh mount with dropped caches:

  plain      the epoch, nothing announced (what every job got before)
  announced  the same order announced first (dlfs.order.client: what
             DLFSSampler does at the start of each epoch), then the epoch;
             the announcement's own time is part of the epoch's
  warm       unthrottled, after one epoch filled the page cache: the next
             epoch plain vs announced, alternating, same mount

and with --nodes N daemons on loopback (default 3, --replicas 1, a pool of
simulated nodes on this one machine), one rank per node, each reading through
its own node's mount with --workers-per-rank processes, orders from DLFSSampler:

  pool epoch 1   fresh pool (empty cache dirs), throttled store, dropped
                 caches: random order not announced vs announced
  peer bytes     pool fully staged, dropped caches: one epoch in mode="random"
                 vs mode="locality" (--window chunks open per rank); the bytes
                 every node read from peers, and the sampler's randomness figure

Targets (issue #24):
  epoch 1 announced / plain (throttled store, single node)   <= 0.5
  epoch 1 announced / plain (throttled store, pool)          <= 0.5
  peer bytes locality / random (pool)                        <= 0.35
  randomness locality / random (pool)                        >= 0.9
  warm epoch plain / announced                                >= 0.97

examples (from the repository root, as root):
  .venv/bin/python bench/order.py --quick
  .venv/bin/python bench/order.py --files 4000 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
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
from _pool import free_ports, source_counts, wait_staged, write_secret

from dlfs.demo.sampledata import generate_tree
from dlfs.demo.workload import ordered_epoch, shuffled_epoch
from dlfs.order.client import connect
from dlfs.order.sampler import DLFSSampler


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--files", type=int, default=3000, help="files (default 3000; --quick 600)")
    p.add_argument("--workers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--store-bandwidth", type=size_arg, default=50 << 20,
                   help="per-stream store rate (default 50M)")
    p.add_argument("--chunk-size", default="16M", help="populate --chunk-size (default 16M)")
    p.add_argument("--mount-args", default="", help="extra `dlfs mount` arguments")
    p.add_argument("--nodes", type=int, default=3,
                   help="simulated pool nodes on loopback (default 3; 0 skips the pool part)")
    p.add_argument("--workers-per-rank", type=int, default=2,
                   help="reader processes per rank in the pool part (default 2)")
    p.add_argument("--window", type=int, default=128,
                   help="locality mode: chunks open at a time per rank (default 128)")
    p.add_argument("--pool-store-bandwidth", type=size_arg, default=10 << 20,
                   help="per-stream store rate in the pool part (default 10M: with three "
                        "simulated nodes on two cores, a faster store leaves the CPUs, not "
                        "the store, the bound; see the staged-pool reference line)")
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
    seconds = time.perf_counter() - started
    if r.files != len(paths):
        raise RuntimeError(f"read {r.files} files, expected {len(paths)}")
    if announce:
        print(f"    announced: {lookahead_summary(mp)}", flush=True)
    return seconds


def lookahead_summary(mp: Path) -> str:
    """What the look-ahead did for the epoch just read: hits, and its fetch width."""
    stats = json.loads((mp / ".dlfs" / "stats.json").read_text())
    taken, counters = stats["mount"]["lookahead"], stats["lookahead"]
    reads = max(1, taken["hits"] + taken["misses"])
    return (f"hits {taken['hits'] / reads:.0%}, fetch width {counters['fetch_width']} "
            f"(grown {counters['fetch_width_grown']} times), "
            f"{counters['samples_prefetched']} samples prefetched")


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


@contextlib.contextmanager
def pool(work: Path, args, extra: list[str]):
    """args.nodes daemons on loopback, one chunk pool (R=1), fresh cache dirs."""
    names = [f"n{i}" for i in range(args.nodes)]
    nodes = ",".join(f"{n}=127.0.0.1:{p}" for n, p in zip(names, free_ports(args.nodes),
                                                           strict=True))
    secret = write_secret(work / "secret")
    with contextlib.ExitStack() as stack:
        mounts = []
        for name in names:
            cache = work / f"cache-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            mounts.append(stack.enter_context(mounted(
                work / "store", work / f"mnt-{name}",
                ["--cache-dir", str(cache), "--node", name, "--nodes", nodes,
                 "--secret-file", str(secret), *extra, *args.mount_args.split()],
                work / f"{name}.log")))
        yield mounts


def samplers(mounts: list[Path], rel: list[str], mode: str, window: int) -> list[DLFSSampler]:
    world = len(mounts)
    return [DLFSSampler([str(mp / "ds" / p) for p in rel], mount=mp, rank=r,
                        world_size=world, mode=mode, window=window, seed=11)
            for r, mp in enumerate(mounts)]


def pool_epoch(ranks: list[DLFSSampler], epoch: int, announce: bool, workers: int) -> float:
    """Every rank reads its share of `epoch` at once; the time of the slowest."""
    for s in ranks:
        s.set_epoch(epoch)
    orders = [list(s) if announce else s.order(epoch).tolist() for s in ranks]  # iter announces
    started = time.perf_counter()
    with ThreadPoolExecutor(len(ranks)) as threads:
        list(threads.map(lambda so: ordered_epoch([so[0].paths[i] for i in so[1]], workers),
                         zip(ranks, orders, strict=True)))
    return time.perf_counter() - started


def pool_epoch1(work: Path, args, rel: list[str], seed: int) -> tuple[float, float]:
    """Epoch 1 on a fresh pool, not announced vs announced; then, on the last pool once
    staged, the same epoch from staged copies only: what the CPUs allow at best."""
    times = {}
    throttle = ["--store-bandwidth", str(args.pool_store_bandwidth)]
    for announce in (False, True) if seed % 2 else (True, False):
        drop_caches()
        with pool(work, args, throttle) as mounts:
            ranks = samplers(mounts, rel, "random", args.window)
            times[announce] = pool_epoch(ranks, seed, announce, args.workers_per_rank)
            if announce == (seed % 2 == 1):  # the second pool of the round
                for mp in mounts:
                    wait_staged(mp)
                drop_caches()
                times["staged"] = pool_epoch(ranks, seed, False, args.workers_per_rank)
            for s in ranks:
                s.close()
    print(f"  pool round {seed}: plain {times[False]:6.2f} s, announced {times[True]:6.2f} s, "
          f"ratio {times[True] / times[False]:.3f}; reference: the same epoch once all is "
          f"staged {times['staged']:6.2f} s", flush=True)
    return times[False], times[True]


def peer_bytes(mounts: list[Path]) -> int:
    return sum(source_counts(mp)["peer"]["bytes"] for mp in mounts)


def pool_locality(work: Path, args, rel: list[str], rounds: int) -> list[tuple[float, float]]:
    """(peer bytes locality / random, randomness locality / random) per round."""
    out = []
    with pool(work, args, []) as mounts:
        for mp in mounts:
            wait_staged(mp)
        modes = {m: samplers(mounts, rel, m, args.window) for m in ("random", "locality")}
        for r in range(rounds):
            peer, entropy = {}, {}
            for mode in ("random", "locality") if r % 2 else ("locality", "random"):
                drop_caches()
                before = peer_bytes(mounts)
                pool_epoch(modes[mode], 300 + r, True, args.workers_per_rank)
                peer[mode] = peer_bytes(mounts) - before
                entropy[mode] = statistics.mean(s.randomness["entropy"] for s in modes[mode])
            out.append((peer["locality"] / max(peer["random"], 1),
                        entropy["locality"] / entropy["random"]))
            print(f"  round {r}: peer bytes random {peer['random'] / (1 << 20):7.1f} MiB, "
                  f"locality {peer['locality'] / (1 << 20):7.1f} MiB (ratio {out[-1][0]:.3f}); "
                  f"randomness random {entropy['random']:.3f}, locality "
                  f"{entropy['locality']:.3f} (ratio {out[-1][1]:.3f})", flush=True)
        for ranks in modes.values():
            for s in ranks:
                s.close()
    return out


def spread(values: list[float]) -> str:
    return (f"min {min(values):.3f} median {statistics.median(values):.3f} "
            f"max {max(values):.3f}")


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
        print(f"  announced / plain: {spread(ratios)}")
        print("warm epochs, unthrottled store, one mount:")
        warm_ratios = warm(work, args, rel, 5 * args.rounds)  # short epochs: more pairs
        print(f"  plain / announced: {spread(warm_ratios)}")
        targets = [Target("epoch 1 announced / plain", statistics.median(ratios), "<=", 0.5)]
        if args.nodes:
            print(f"pool of {args.nodes} nodes on loopback (R=1), epoch 1, store "
                  f"{args.pool_store_bandwidth / (1 << 20):.0f} MiB/s per stream:")
            pool_pairs = [pool_epoch1(work, args, rel, seed)
                          for seed in range(1, args.rounds + 1)]
            pool_ratios = [a / p for p, a in pool_pairs]
            print(f"  announced / plain: {spread(pool_ratios)}")
            print(f"pool fully staged, random vs locality (window {args.window}):")
            loc = pool_locality(work, args, rel, args.rounds)
            print(f"  peer bytes locality / random: {spread([p for p, _ in loc])}; "
                  f"randomness locality / random: {spread([e for _, e in loc])}")
            targets += [
                Target("pool epoch 1 announced / plain", statistics.median(pool_ratios),
                       "<=", 0.5),
                Target("pool peer bytes locality / random",
                       statistics.median([p for p, _ in loc]), "<=", 0.35),
                Target("pool randomness locality / random",
                       statistics.median([e for _, e in loc]), ">=", 0.9)]
    targets.append(Target("warm epoch plain / announced", statistics.median(warm_ratios),
                          ">=", 0.97))
    print_targets(targets, args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

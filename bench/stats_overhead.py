"""What the I/O counters and the trace cost: random-order small-file reads on three mounts.

The same workload as bench/random_read.py (dlfs.demo.workload.shuffled_epoch: every
file read once, whole, in a seeded random order, split over --workers reader
processes), on two synthetic trees (~110 KiB ImageNet-like, ~2.5 KB
BERT-like), through three mounts of the same store:

  off     dlfs mount --no-stats          (counters and trace switched off)
  stats   dlfs mount                     (the default: counters on, trace off)
  trace   dlfs mount + dlfs trace start  (counters on, every operation traced)

The machine is shared and its speed drifts by tens of percent within
seconds, so the variants are interleaved finely: each round mounts all three
side by side (fresh mounts: empty page caches), then reads the shuffled file
list in batches of --batch files, every batch through each mount in turn
(the order rotates per batch). Two passes per round:

  daemon  first read of every file: each read reaches the daemon (the store's
          chunk files stay in the host page cache, so the daemon's CPU per
          request, where the counters cost most, is measured, not the disk)
  cached  second pass: page-cache hits; the daemon sees nothing of them (the
          kernel opens files itself), or opens and releases with
          --mount-args=--count-opens

files/s per variant = files read / time spent reading them, summed over all
batches and rounds; the ratios stats/off and trace/off come from the same
batches.

Targets (issue 5): stats/off >= 0.97, trace/off >= 0.85.

examples (from the repository root; run as root for cache drops):
  .venv/bin/python bench/stats_overhead.py --quick
  .venv/bin/python bench/stats_overhead.py --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from _common import (
    Target,
    add_common_args,
    formatter,
    mounted,
    populate,
    print_table,
    print_targets,
    run_dlfs,
    run_main,
    split_args,
    workdir,
)

from dlfs.demo.sampledata import generate_tree

VARIANTS = {"off": ["--no-stats"], "stats": [], "trace": []}


@dataclass
class Tree:
    name: str
    label: str
    files: int
    mean: int
    paths: list[str] = field(default_factory=list)
    bytes: int = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p, rounds=3)
    p.add_argument("--large-files", type=int, default=5000,
                   help="files in the ~110 KiB tree (default 5000; --quick: 250)")
    p.add_argument("--small-files", type=int, default=20_000,
                   help="files in the ~2.5 KB tree (default 20000; --quick: 1000)")
    p.add_argument("--workers", type=int, default=2, help="reader processes (default 2)")
    p.add_argument("--batch", type=int, default=200,
                   help="files per interleaved batch (default 200)")
    p.add_argument("--mount-args", default="",
                   help="extra `dlfs mount` arguments for all three mounts, e.g. "
                        "--mount-args=--count-opens (opens and closes reach the daemon)")
    args = p.parse_args(argv)
    if args.quick:
        args.large_files = max(1, args.large_files // 20)
        args.small_files = max(1, args.small_files // 20)
    return args


PASSES = ("daemon", "cached")


def _read_batch(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total


def timed_batch(pool, shards: list[list[str]]) -> tuple[float, int]:
    started = time.perf_counter()
    nbytes = sum(pool.map(_read_batch, shards))
    return time.perf_counter() - started, nbytes


def one_round(tree: Tree, store: Path, work: Path, args: argparse.Namespace, rnd: int,
              pool, seconds: dict) -> None:
    order = list(tree.paths)
    random.Random(rnd).shuffle(order)
    batches = [order[i : i + args.batch] for i in range(0, len(order), args.batch)]
    with contextlib.ExitStack() as stack:
        mps = {}
        for variant, extra in VARIANTS.items():
            mp = work / f"mnt-{variant}"
            stack.enter_context(mounted(store, mp, [*extra, *split_args(args.mount_args)],
                                        work / f"dlfsd-{variant}.log"))
            mps[variant] = mp
        run_dlfs(["trace", "start", str(mps["trace"])])
        names = list(VARIANTS)
        for phase in PASSES:
            for i, batch in enumerate(batches):
                for variant in names[i % 3:] + names[: i % 3]:
                    paths = [str(mps[variant] / tree.name / p) for p in batch]
                    took, nbytes = timed_batch(pool, [paths[j::args.workers]
                                                      for j in range(args.workers)])
                    key = (tree.name, phase, variant)
                    seconds[key] = seconds.get(key, 0.0) + took
                    bytes_key = (*key, "bytes")
                    seconds[bytes_key] = seconds.get(bytes_key, 0) + nbytes
        status = run_dlfs(["trace", "status", str(mps["trace"])]).stdout.strip()
        run_dlfs(["trace", "stop", str(mps["trace"]), "-o", str(work / "trace.csv")])
    line = "   ".join(
        f"{phase} " + " ".join(f"{v} {len(order) * (rnd + 1) / seconds[(tree.name, phase, v)]:,.0f}"
                                for v in VARIANTS) for phase in PASSES)
    print(f"  {tree.label:>7} files/s so far: {line}   [trace: {status.split(': ', 1)[-1]}]",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = [Tree("imagenet", "110KiB", args.large_files, 110 << 10),
             Tree("bert", "2.5KB", args.small_files, 2500)]
    with workdir(args.workdir, args.keep, "stats-overhead") as work:
        store = work / "store"
        for tree in trees:
            src = work / f"src-{tree.name}"
            summary = generate_tree(src, tree.files, tree.mean, seed=1)
            tree.paths = [str(p.relative_to(src)) for p in summary.paths]
            tree.bytes = summary.bytes
            took = populate(src, store, tree.name)
            print(f"{tree.name}: {tree.files:,} files, {tree.bytes / (1 << 20):,.1f} MiB; "
                  f"populate {took:.1f} s")
        seconds: dict = {}
        ctx = mp.get_context("fork")
        with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
            for rnd in range(args.rounds):
                print(f"round {rnd + 1}/{args.rounds}")
                for tree in trees:
                    one_round(tree, store, work, args, rnd, pool, seconds)
        for tree in trees:
            for phase in PASSES:
                for variant in VARIANTS:
                    got = seconds[(tree.name, phase, variant, "bytes")]
                    if got != tree.bytes * args.rounds:
                        raise RuntimeError(f"{variant} {phase} read {got} bytes, expected "
                                           f"{tree.bytes * args.rounds}")
        rows, ratios = [], {}
        names = list(VARIANTS)
        for tree in trees:
            for temp in PASSES:
                fps = {v: tree.files * args.rounds / seconds[(tree.name, temp, v)]
                       for v in names}
                ratios[(tree.name, temp, "stats")] = fps["stats"] / fps["off"]
                ratios[(tree.name, temp, "trace")] = fps["trace"] / fps["off"]
                rows.append((f"{tree.label} {temp}", fps["off"], fps["stats"], fps["trace"],
                             ratios[(tree.name, temp, "stats")],
                             ratios[(tree.name, temp, "trace")]))
        print_table(("tree / cache", "off files/s", "stats files/s", "trace files/s",
                     "stats/off", "trace/off"), rows,
                    title=f"{args.rounds} rounds, batches of {args.batch} files interleaved, "
                          f"{args.workers} readers")
        worst_stats = min(v for (_, _, k), v in ratios.items() if k == "stats")
        worst_trace = min(v for (_, _, k), v in ratios.items() if k == "trace")
        print_targets([Target("counters on / off (worst of the four)", worst_stats, ">=", 0.97),
                       Target("trace on / off (worst of the four)", worst_trace, ">=", 0.85)],
                      args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

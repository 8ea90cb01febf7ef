"""Staging overlapped with training vs "stage everything, then read"; staging vs cp.

One dataset of ~110 KiB files, one node with a --cache-dir (a pool of one:
it owns every chunk). The store is throttled to --store-bandwidth per read
stream (default 50 MiB/s: a parallel file system gives each stream a bounded
rate; the aggregate grows with streams), through the daemon's benchmark-only
`--store-bandwidth` flag, which paces every store read the daemon makes.

Per round, each on a fresh mount with an empty cache dir and dropped caches:

  staged-first  mount, wait until every chunk is staged (T_stage), then one
                shuffled epoch (T_epoch_staged): total = T_stage + T_epoch_staged
  overlapped    mount and start the epoch at once (T_overlap); reads of chunks
                not staged yet go to the store and jump the staging queue.
                Then wait for staging to end, drop caches, and read a second
                epoch (T_second) on the same mount.
  cp            unthrottled: `cp -r` of the store's chunk files to a scratch
                dir (+ sync) vs the daemon staging the same chunks unthrottled,
                timed by the stager itself from its start to its last copy (the
                mount's own start-up, ~1 s, is printed beside it)

Targets (issue #3):
  overlapped / staged-first total               <= 0.6
  second epoch / epoch on a fully staged cache  <= 1.1 (within 10%)
  staging rate unthrottled / cp rate            >= 0.8

examples (from the repository root, as root):
  .venv/bin/python bench/staging.py --quick
  .venv/bin/python bench/staging.py --files 8000 --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path

from _common import (
    Target,
    add_common_args,
    drop_caches,
    formatter,
    median,
    mounted,
    populate,
    print_table,
    print_targets,
    run_main,
    size_arg,
    sync,
    workdir,
)
from _pool import source_counts, status, wait_staged

from dlfs.demo.sampledata import generate_tree
from dlfs.demo.workload import shuffled_epoch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--files", type=int, default=6000, help="files (default 6000; --quick 1500)")
    p.add_argument("--workers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--store-bandwidth", type=size_arg, default=50 << 20,
                   help="per-stream store rate (default 50M)")
    p.add_argument("--chunk-size", default="16M", help="populate --chunk-size (default 16M)")
    p.add_argument("--mount-args", default="", help="extra `dlfs mount` arguments")
    args = p.parse_args(argv)
    if args.quick:
        args.files = max(200, args.files // 4)
    return args


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def epoch(mp: Path, paths: list[str], nbytes: int, workers: int, seed: int) -> float:
    r = shuffled_epoch([str(mp / "ds" / p) for p in paths], workers, seed=seed)
    if r.bytes != nbytes:
        raise RuntimeError(f"read {r.bytes} bytes, expected {nbytes}")
    return r.seconds


def staged_first(work: Path, args, paths, nbytes, seed) -> tuple[float, float]:
    mount_args = ["--cache-dir", str(fresh(work / "cache")),
                  "--store-bandwidth", str(args.store_bandwidth), *args.mount_args.split()]
    drop_caches()
    started = time.monotonic()
    with mounted(work / "store", work / "mnt", mount_args, work / "dlfsd.log") as mp:
        t_stage = wait_staged(mp) - started
        drop_caches()
        t_epoch = epoch(mp, paths, nbytes, args.workers, seed)
    print(f"  staged-first  stage {t_stage:6.2f} s + epoch {t_epoch:6.2f} s = "
          f"{t_stage + t_epoch:6.2f} s", flush=True)
    return t_stage, t_epoch


def overlapped(work: Path, args, paths, nbytes, seed) -> tuple[float, float]:
    mount_args = ["--cache-dir", str(fresh(work / "cache")),
                  "--store-bandwidth", str(args.store_bandwidth), *args.mount_args.split()]
    drop_caches()
    started = time.monotonic()
    with mounted(work / "store", work / "mnt", mount_args, work / "dlfsd.log") as mp:
        epoch(mp, paths, nbytes, args.workers, seed)
        t_over = time.monotonic() - started
        counts = source_counts(mp)
        wait_staged(mp)
        drop_caches()
        t_second = epoch(mp, paths, nbytes, args.workers, seed + 1)
    mib = {k: v["bytes"] / (1 << 20) for k, v in counts.items()}
    print(f"  overlapped    epoch {t_over:6.2f} s (incl. mount; local {mib['local']:.0f} MiB, "
          f"store {mib['store']:.0f} MiB); second epoch {t_second:6.2f} s", flush=True)
    return t_over, t_second


def cp_vs_stage(work: Path, args, chunk_bytes: int) -> tuple[float, float]:
    target = fresh(work / "cp-target")
    drop_caches()
    started = time.monotonic()
    subprocess.run(["cp", "-r", str(work / "store" / "ds" / "chunks"), str(target)], check=True)
    sync()
    t_cp = time.monotonic() - started
    drop_caches()
    started = time.monotonic()
    with mounted(work / "store", work / "mnt", ["--cache-dir", str(fresh(work / "cache")),
                                                 *args.mount_args.split()],
                 work / "dlfsd.log") as mp:
        wait_staged(mp, poll=0.01)
        sync()
        t_with_mount = time.monotonic() - started
        rate = status(mp)["datasets"][0]["staging"]["rate"]  # first copy to last, stager's clock
    shutil.rmtree(target, ignore_errors=True)
    mib = chunk_bytes / (1 << 20)
    t_stage = chunk_bytes / rate
    print(f"  cp {t_cp:6.2f} s ({mib / t_cp:7.1f} MiB/s); stager {t_stage:6.2f} s "
          f"({rate / (1 << 20):7.1f} MiB/s); mount + stage + sync {t_with_mount:6.2f} s",
          flush=True)
    return t_cp, t_stage


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with workdir(args.workdir, args.keep, "staging") as work:
        summary = generate_tree(work / "src", args.files, 110 << 10, seed=1)
        paths = [str(p.relative_to(work / "src")) for p in summary.paths]
        took = populate(work / "src", work / "store", "ds",
                        ["--chunk-size", args.chunk_size, "--no-fsync"])
        chunk_bytes = sum(p.stat().st_size for p in (work / "store" / "ds" / "chunks").iterdir())
        print(f"{args.files:,} files, {summary.bytes / (1 << 20):,.1f} MiB; populate {took:.1f} s;"
              f" store {args.store_bandwidth / (1 << 20):.0f} MiB/s per stream; "
              f"{args.workers} reader processes")
        res: dict[str, list[float]] = {}
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}")
            runs = [staged_first, overlapped] if rnd % 2 == 0 else [overlapped, staged_first]
            for run in runs:
                a, b = run(work, args, paths, summary.bytes, rnd)
                res.setdefault(run.__name__, []).append(a + b if run is staged_first else a)
                res.setdefault(run.__name__ + "-epoch", []).append(b)
            t_cp, t_stage = cp_vs_stage(work, args, chunk_bytes)
            res.setdefault("cp", []).append(t_cp)
            res.setdefault("stage", []).append(t_stage)
        total_first, total_over = median(res["staged_first"]), median(res["overlapped"])
        epoch_staged, second = median(res["staged_first-epoch"]), median(res["overlapped-epoch"])
        t_cp, t_stage = median(res["cp"]), median(res["stage"])
        print_table(("measure", "seconds", "baseline s", "ratio"), [
            ("overlapped vs staged-first", total_over, total_first, total_over / total_first),
            ("second epoch vs staged epoch", second, epoch_staged, second / epoch_staged),
            ("staging vs cp (time)", t_stage, t_cp, t_stage / t_cp),
        ], title=f"medians of {args.rounds} rounds")
        print_targets([
            Target("overlapped / staged-first total", total_over / total_first, "<=", 0.6),
            Target("second epoch / fully staged epoch", second / epoch_staged, "<=", 1.1),
            Target("staging rate / cp rate", t_cp / t_stage, ">=", 0.8),
        ], args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

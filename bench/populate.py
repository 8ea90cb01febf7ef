"""Populate throughput: `dlfs populate` vs `tar -cf` of the same tree.

A tree is packed by each of these commands, each timed as a whole subprocess
(wall clock):

  populate          dlfs populate SRC --store S --name N       (fsyncs before publishing)
  populate-nofsync  dlfs populate ... --no-fsync
  populate@base     dlfs populate, run from the checkout given with --baseline (the code
                    before a change, measured in the same run against the same tar)
  populate-mpi2     mpirun -n 2 dlfs populate ... (two ranks share the work; needs
                    mpi4py and mpirun; not in the default set)
  tar               tar -cf OUT.tar -C SRC .
  tar+sync          tar -cf ... followed by sync (durable, like populate)

Trees: by default 20,000 files of ~110 KiB lognormal samples
(dlfs.demo.sampledata.generate_tree); with --tiny N, N files of exactly 2,500 bytes,
1,000 per directory (BERT/LLM-token records, ImageNet-21k thumbnails), where the
cost per file is all there is.

Before every run the previous run's output is deleted and synced away, then the
source is made warm (read once) or, with --cold, the page cache is dropped (as
root): neither is timed. The order of the variants rotates every round. Every
ratio is taken within a round (same machine load) and reported as
min/median/max over the rounds, next to the times.

Targets (issue 21): populate <= 1.2x tar+sync for tiny files; <= 1.1x for the
110 KiB tree. Reported three ways: like-for-like durable (populate /
tar+sync), like-for-like non-durable (populate --no-fsync / tar), and the
strictest reading (populate / plain tar).

examples (from the repository root; run as root for cache drops):
  .venv/bin/python bench/populate.py --quick
  .venv/bin/python bench/populate.py
  .venv/bin/python bench/populate.py --tiny 200000 --cold --rounds 5
  .venv/bin/python bench/populate.py --tiny 200000 --cold --baseline /tmp/dlfs-main
  .venv/bin/python bench/populate.py --tiny 1000000 --cold --variants populate,tar+sync
  .venv/bin/python bench/populate.py --populate-args='-j 4'
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import (
    DLFS,
    Target,
    add_common_args,
    drop_caches,
    formatter,
    print_table,
    print_targets,
    run_dlfs,
    run_main,
    split_args,
    sync,
    workdir,
)

from dlfs.demo.sampledata import generate_tree

VARIANTS = ("populate", "populate-nofsync", "populate@base", "populate-mpi2", "tar",
            "tar+sync")
TINY_SIZE = 2500
TINY_PER_DIR = 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--files", type=int, default=20_000,
                   help="files in the tree (default 20000; --quick: 1000)")
    p.add_argument("--mean-size", type=int, default=110 << 10,
                   help="mean file size in bytes (default 112640 = 110 KiB)")
    p.add_argument("--tiny", type=int, default=0, metavar="N",
                   help=f"instead: N files of exactly {TINY_SIZE} bytes, {TINY_PER_DIR} per "
                        "directory (--quick: N/20)")
    p.add_argument("--cold", action="store_true",
                   help="drop the page cache before every run (root) instead of warming "
                        "the source")
    p.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                   help="a checkout of dlfs (e.g. `git worktree add DIR main`) whose "
                        "populate runs too, as populate@base")
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of " + ",".join(VARIANTS) +
                        " (default: all; populate@base only with --baseline)")
    p.add_argument("--populate-args", default="",
                   help="extra arguments for `dlfs populate`, e.g. --populate-args='-j 4'")
    args = p.parse_args(argv)
    if args.quick:
        args.files = max(1, args.files // 20)
        args.tiny = args.tiny // 20
    wanted = [v for v in VARIANTS
              if (v != "populate@base" or args.baseline) and v != "populate-mpi2"]
    if args.variants:
        wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in wanted if v not in VARIANTS]
        if unknown:
            p.error(f"unknown variants: {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
        if "populate@base" in wanted and not args.baseline:
            p.error("populate@base needs --baseline DIR")
    args.variants = tuple(wanted)
    if args.baseline and not (args.baseline / "dlfs" / "store" / "populate.py").is_file():
        p.error(f"--baseline {args.baseline}: no dlfs checkout there (dlfs/store/populate.py)")
    return args


def generate_tiny_tree(root: Path, files: int, seed: int = 4) -> tuple[int, list[Path]]:
    """`files` files of TINY_SIZE bytes, TINY_PER_DIR per directory, every one different."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = rng.bytes(1 << 20)
    starts = rng.integers(0, len(pool) - TINY_SIZE, files).tolist()
    paths = []
    for i, start in enumerate(starts):
        directory = root / "train" / f"c{i // TINY_PER_DIR:05d}"
        if i % TINY_PER_DIR == 0:
            directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"sample_{i:07d}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, pool[start : start + TINY_SIZE])
        finally:
            os.close(fd)
        paths.append(path)
    return files * TINY_SIZE, paths


def warm(paths: list[Path]) -> int:
    """Read every file once (into one reused buffer); returns the bytes read."""
    total = 0
    buf = bytearray(1 << 20)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total


def run_variant(variant: str, src: Path, out: Path, extra: list[str],
                baseline: Path | None) -> float:
    if variant.startswith("populate"):
        argv = [*DLFS, "populate", str(src), "--store", str(out / "store"), "--name", "ds",
                *extra]
        env, cwd = None, None
        if variant == "populate-nofsync":
            argv.append("--no-fsync")
        elif variant == "populate-mpi2":
            argv = ["mpirun", "-n", "2", "--allow-run-as-root", "--oversubscribe", *argv]
        elif variant == "populate@base":
            # `python -m` puts the working directory first on sys.path: run it in the
            # baseline, or the dlfs of the directory the bench was started in is timed
            argv = [sys.executable, "-m", "dlfs.cli.main", *argv[len(DLFS):]]
            env = {**os.environ, "PYTHONPATH": str(baseline.resolve())}
            cwd = baseline
        started = time.perf_counter()
        result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
        took = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError(f"{variant} failed ({result.returncode}): {result.stderr.strip()}")
        return took
    started = time.perf_counter()
    subprocess.run(["tar", "-cf", str(out / "out.tar"), "-C", str(src), "."], check=True)
    if variant == "tar+sync":
        sync()
    return time.perf_counter() - started


def baseline_module(baseline: Path) -> str:
    """The populate module the baseline runs really import (printed, to be sure)."""
    return subprocess.run(
        [sys.executable, "-c", "import dlfs.store.populate as p; print(p.__file__)"],
        cwd=baseline, env={**os.environ, "PYTHONPATH": str(baseline.resolve())},
        capture_output=True, text=True, check=True).stdout.strip()


def spread(values: list[float]) -> str:
    """min/median/max, the way every figure of this script is reported."""
    if not values:
        return "-"
    return f"{min(values):.2f}/{statistics.median(values):.2f}/{max(values):.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra = split_args(args.populate_args)
    variants = args.variants
    with workdir(args.workdir, args.keep, "populate") as work:
        src = work / "src"
        started = time.perf_counter()
        if args.tiny:
            total, paths = generate_tiny_tree(src, args.tiny)
            files = args.tiny
        else:
            summary = generate_tree(src, args.files, args.mean_size, seed=4)
            total, paths, files = summary.bytes, summary.paths, args.files
        mib = total / (1 << 20)
        print(f"tree: {files:,} files, {mib:,.1f} MiB (mean {total / files / 1024:.2f} KiB), "
              f"made in {time.perf_counter() - started:.0f} s; populate args: {extra or '-'}; "
              f"{'cold (page cache dropped before each run)' if args.cold else 'warm source'}"
              + (f"; baseline: {baseline_module(args.baseline)}" if args.baseline else ""))
        out = work / "out"
        times: dict[str, list[float]] = {v: [] for v in variants}
        for rnd in range(args.rounds):
            order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
            for variant in order:
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                sync()
                if args.cold:
                    drop_caches()
                elif warm(paths) != total:
                    raise RuntimeError("source tree changed while benchmarking")
                times[variant].append(run_variant(variant, src, out, extra, args.baseline))
            print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{v} {times[v][-1]:.2f} s" for v in variants), flush=True)
        shutil.rmtree(out, ignore_errors=True)
        sync()
        startup = []
        for _ in range(3):
            started = time.perf_counter()
            run_dlfs(["--help"])  # not --version: it starts the daemon too
            startup.append(time.perf_counter() - started)

        def ratios(a: str, b: str) -> list[float]:
            if a not in times or b not in times:
                return []
            return [x / y for x, y in zip(times[a], times[b], strict=True)]

        rows = []
        for v in variants:
            med = statistics.median(times[v])
            rows.append((v, spread(times[v]), mib / med, files / med,
                         spread(ratios(v, "tar")), spread(ratios(v, "tar+sync"))))
        print_table(("command", "seconds min/med/max", "MiB/s (med)", "files/s (med)",
                     "x tar (per round)", "x tar+sync (per round)"), rows,
                    title=f"{args.rounds} rounds (whole command, wall clock); ratios taken "
                          "within each round, min/median/max")
        print(f"  (fixed cost included in every populate row: `dlfs --help` takes "
              f"{statistics.median(startup):.2f} s)")
        if "populate-mpi2" in times and "populate" in times:
            print("  mpirun -n 2 populate / populate per round: "
                  f"{spread(ratios('populate-mpi2', 'populate'))}")
        if "populate@base" in times and "populate" in times:
            print("  populate / populate@base per round: "
                  f"{spread(ratios('populate', 'populate@base'))}")
        limit = 1.2 if args.tiny else 1.1
        targets = []
        for label, a, b in (("populate / tar+sync (both durable)", "populate", "tar+sync"),
                            ("populate --no-fsync / tar (neither durable)", "populate-nofsync",
                             "tar"),
                            ("populate / tar (strictest reading)", "populate", "tar")):
            if ratios(a, b):
                targets.append(Target(label + ", median", statistics.median(ratios(a, b)),
                                      "<=", limit, "x"))
        print_targets(targets, args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

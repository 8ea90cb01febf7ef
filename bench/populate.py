"""Populate throughput: `dlfs populate` vs `tar -cf` of the same tree.

A 20,000-file tree of ~110 KiB lognormal samples (dlfs.sampledata.generate_tree)
is packed by four commands, each timed as a whole subprocess (wall clock):

  populate          dlfs populate SRC --store S --name N       (fsyncs before publishing)
  populate-nofsync  dlfs populate ... --no-fsync
  tar               tar -cf OUT.tar -C SRC .
  tar+sync          tar -cf ... followed by sync (durable, like populate)

The source is warm for every run (the tree is read once before each run, not
timed), the previous run's output is deleted and synced away before the next
(not timed), and the order of the four rotates every round. Times are medians
of --rounds.

Target (from the issue): populate <= 1.5x tar. Reported three ways:
like-for-like durable (populate / tar+sync), like-for-like non-durable
(populate --no-fsync / tar), and the strictest reading (populate / plain tar).

examples (from the repository root; run as root for cache drops):
  .venv/bin/python bench/populate.py --quick
  .venv/bin/python bench/populate.py
  .venv/bin/python bench/populate.py --populate-args='-j 4'
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
    formatter,
    median,
    populate,
    print_table,
    print_targets,
    run_dlfs,
    run_main,
    split_args,
    sync,
    workdir,
)

from dlfs.sampledata import generate_tree

VARIANTS = ("populate", "populate-nofsync", "tar", "tar+sync")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--files", type=int, default=20_000,
                   help="files in the tree (default 20000; --quick: 1000)")
    p.add_argument("--mean-size", type=int, default=110 << 10,
                   help="mean file size in bytes (default 112640 = 110 KiB)")
    p.add_argument("--populate-args", default="",
                   help="extra arguments for `dlfs populate`, e.g. --populate-args='-j 4'")
    args = p.parse_args(argv)
    if args.quick:
        args.files = max(1, args.files // 20)
    return args


def warm(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total


def run_variant(variant: str, src: Path, out: Path, extra: list[str]) -> float:
    if variant.startswith("populate"):
        flags = ["--no-fsync"] if variant == "populate-nofsync" else []
        return populate(src, out / "store", "ds", [*flags, *extra])
    started = time.perf_counter()
    subprocess.run(["tar", "-cf", str(out / "out.tar"), "-C", str(src), "."], check=True)
    if variant == "tar+sync":
        sync()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra = split_args(args.populate_args)
    with workdir(args.workdir, args.keep, "populate") as work:
        src = work / "src"
        summary = generate_tree(src, args.files, args.mean_size, seed=4)
        mib = summary.bytes / (1 << 20)
        print(f"tree: {args.files:,} files, {mib:,.1f} MiB (mean "
              f"{summary.bytes / args.files / 1024:.1f} KiB); populate args: {extra or '-'}")
        out = work / "out"
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for rnd in range(args.rounds):
            order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[: rnd % len(VARIANTS)]
            for variant in order:
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                sync()
                if warm(summary.paths) != summary.bytes:
                    raise RuntimeError("source tree changed while benchmarking")
                times[variant].append(run_variant(variant, src, out, extra))
            print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{v} {times[v][-1]:.2f} s" for v in VARIANTS), flush=True)
        shutil.rmtree(out, ignore_errors=True)
        sync()
        startup = []
        for _ in range(3):
            started = time.perf_counter()
            run_dlfs(["--version"])
            startup.append(time.perf_counter() - started)

        med = {v: median(t) for v, t in times.items()}
        rows = [(v, med[v], mib / med[v], med[v] / med["tar"], med[v] / med["tar+sync"],
                 " ".join(f"{x:.2f}" for x in times[v])) for v in VARIANTS]
        print_table(("command", "seconds", "MiB/s", "x tar", "x tar+sync", "runs"), rows,
                    title=f"medians of {args.rounds} rounds (whole command, wall clock)")
        print(f"  (fixed cost included in both populate rows: `dlfs --version` takes "
              f"{median(startup):.2f} s)")
        print_targets([
            Target("populate / tar+sync (both durable)", med["populate"] / med["tar+sync"],
                   "<=", 1.5, "x"),
            Target("populate --no-fsync / tar (neither durable)",
                   med["populate-nofsync"] / med["tar"], "<=", 1.5, "x"),
            Target("populate / tar (strictest reading)", med["populate"] / med["tar"],
                   "<=", 1.5, "x"),
        ], args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

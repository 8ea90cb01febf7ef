"""Random-order small-file reads: DLFS mount vs the source directory.

Two synthetic trees (dlfs.demo.sampledata.generate_tree): 20,000 files of ~110 KiB
(ImageNet-like) and 100,000 files of ~2.5 KB (BERT-like), both lognormal.
Each is packed with `dlfs populate` into one store, which is then mounted.

One epoch = every file read once, whole, in a seeded random order, split over
--workers processes (dlfs.demo.workload.shuffled_epoch: what a DataLoader does).
Each round, for each tree, source and mount alternate (the order flips every
round), and each side does:

  cold   drop the page/dentry/inode caches, then one epoch
  warm   one more epoch (another shuffle) right after: every file was just read

For the mount side every round uses a fresh `dlfs mount` (mounted before the
cache drop, not timed), so daemon-side state (checksums already verified)
does not carry over into the next cold run. Figures are medians over
--rounds; ratios are mount/source, from the same process and the same disk.

Targets (from the issue):
  warm  110 KiB  mount/source >= 0.45
  warm  2.5 KB   mount/source >= 0.15
  cold  110 KiB  mount/source >= 0.70     (cold 2.5 KB is reported, no target)

--compare-args / --compare-pythonpath add a third side, "other", measured in the
same rounds (the order rotates over the three): a mount with other arguments
(e.g. --count-opens: the daemon answers every OPEN, as a mount serving large
files by passthrough does) or of another checkout's code (before/after).

examples (from the repository root; run as root for cache drops):
  .venv/bin/python bench/random_read.py --quick
  .venv/bin/python bench/random_read.py --compare-args='--count-opens'
  .venv/bin/python bench/random_read.py --compare-pythonpath /tmp/dlfs-main
  .venv/bin/python bench/random_read.py --workers 1 --small-files 0 --rounds 5
  .venv/bin/python bench/random_read.py
  .venv/bin/python bench/random_read.py --mount-args='--no-verify'
  .venv/bin/python bench/random_read.py --rounds 5 --workers 4 --keep
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
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
    split_args,
    workdir,
)

from dlfs.demo.sampledata import generate_tree
from dlfs.demo.workload import EpochResult, shuffled_epoch


@dataclass
class TreeSpec:
    name: str
    label: str
    files: int
    mean: int
    paths: list[str] = field(default_factory=list)
    bytes: int = 0


@dataclass
class Runs:
    results: dict[tuple[str, str], list[EpochResult]] = field(default_factory=dict)

    def add(self, side: str, temp: str, r: EpochResult) -> None:
        self.results.setdefault((side, temp), []).append(r)

    def files_per_s(self, side: str, temp: str) -> float:
        return median([r.files_per_s for r in self.results.get((side, temp), [])])

    def mib_per_s(self, side: str, temp: str) -> float:
        return median([r.mib_per_s for r in self.results.get((side, temp), [])])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--large-files", type=int, default=20_000,
                   help="files in the ~110 KiB tree (default 20000; --quick: 1000)")
    p.add_argument("--small-files", type=int, default=100_000,
                   help="files in the ~2.5 KB tree (default 100000; --quick: 5000)")
    p.add_argument("--workers", type=int, default=2, help="reader processes (default 2)")
    p.add_argument("--mount-args", default="",
                   help="extra arguments for `dlfs mount`, one string, e.g. "
                        "--mount-args='--no-verify --workers 8' (note the '=')")
    p.add_argument("--populate-args", default="",
                   help="extra arguments for `dlfs populate`, e.g. --populate-args='-j 4'")
    p.add_argument("--compare-args", default=None,
                   help="also measure a mount with these `dlfs mount` arguments (the "
                        "\"other\" side), e.g. --compare-args='--count-opens'")
    p.add_argument("--compare-pythonpath", default=None, metavar="DIR",
                   help="the \"other\" side runs the code of DIR (holding `dlfs` and "
                        "`dlfsd` packages, e.g. `git archive main` with a dlfsd -> daemon "
                        "link), with --compare-args or --mount-args")
    args = p.parse_args(argv)
    if args.quick:
        args.large_files = max(1, args.large_files // 20)
        args.small_files = max(1, args.small_files // 20)
    return args


def one_side(side: str, tree: TreeSpec, prefix: Path, workers: int, seed: int,
             runs: Runs) -> None:
    paths = [str(prefix / p) for p in tree.paths]
    drop_caches()
    cold = shuffled_epoch(paths, workers, seed=seed)
    warm = shuffled_epoch(paths, workers, seed=seed + 1000)
    for temp, r in (("cold", cold), ("warm", warm)):
        if r.bytes != tree.bytes:
            raise RuntimeError(f"{side} {temp} read {r.bytes} bytes, expected {tree.bytes}")
        runs.add(side, temp, r)
    print(f"  {tree.label:>8} {side:<6} cold {cold.files_per_s:9,.0f} files/s "
          f"{cold.mib_per_s:8,.1f} MiB/s   warm {warm.files_per_s:9,.0f} files/s "
          f"{warm.mib_per_s:8,.1f} MiB/s", flush=True)


def print_compare(trees: list[TreeSpec], all_runs: dict[str, Runs], rounds: int) -> None:
    """The "other" side next to the mount: per round ratios to the source, min/median/max."""
    rows = []
    for tree in trees:
        runs = all_runs[tree.name]
        for temp in ("cold", "warm"):
            per = {side: [m.files_per_s / s.files_per_s for m, s in zip(
                runs.results.get((side, temp), []), runs.results.get(("source", temp), []),
                strict=False)] for side in ("mount", "other")}
            spread = {side: f"{min(r):.3f} / {median(r):.3f} / {max(r):.3f}" if r else "-"
                      for side, r in per.items()}
            rows.append((f"{tree.label} {temp}", spread["mount"], spread["other"],
                         runs.files_per_s("other", temp) / runs.files_per_s("mount", temp)))
    print_table(("tree / cache", "mount/source min/med/max", "other/source min/med/max",
                 "other/mount (medians)"), rows,
                title=f"per-round ratios to the source, {rounds} rounds")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mount_args = split_args(args.mount_args)
    trees = [TreeSpec("imagenet", "110KiB", args.large_files, 110 << 10),
             TreeSpec("bert", "2.5KB", args.small_files, 2500)]
    trees = [t for t in trees if t.files > 0]  # --small-files 0: the 110 KiB tree only
    if not trees:
        raise SystemExit("random_read.py: nothing to read (--large-files 0 --small-files 0)")
    with workdir(args.workdir, args.keep, "random-read") as work:
        store = work / "store"
        mp = work / "mnt"
        print(f"mount args: {mount_args or '(default)'}; workers: {args.workers}; "
              f"rounds: {args.rounds}")
        for tree in trees:
            src = work / f"src-{tree.name}"
            summary = generate_tree(src, tree.files, tree.mean, seed=1)
            tree.paths = [str(p.relative_to(src)) for p in summary.paths]
            tree.bytes = summary.bytes
            took = populate(src, store, tree.name, split_args(args.populate_args))
            print(f"{tree.name}: {tree.files:,} files, {tree.bytes / (1 << 20):,.1f} MiB "
                  f"(mean {tree.bytes / tree.files / 1024:.1f} KiB); populate {took:.1f} s")

        all_runs = {tree.name: Runs() for tree in trees}
        compare = args.compare_args is not None or args.compare_pythonpath is not None
        sides = ("source", "mount", "other") if compare else ("source", "mount")
        other_args = split_args(args.compare_args) if args.compare_args is not None \
            else mount_args
        if compare:
            print(f"other: mount args {other_args or '(default)'}, code "
                  f"{args.compare_pythonpath or 'this checkout'}")
        for rnd in range(args.rounds):
            shift = rnd % len(sides)
            order = sides[shift:] + sides[:shift] if compare else \
                (("source", "mount") if rnd % 2 == 0 else ("mount", "source"))
            print(f"round {rnd + 1}/{args.rounds} ({' then '.join(order)})")
            for tree in trees:
                for side in order:
                    if side == "source":
                        one_side(side, tree, work / f"src-{tree.name}", args.workers, rnd,
                                 all_runs[tree.name])
                    elif side == "mount":
                        with mounted(store, mp, mount_args, work / "dlfsd.log"):
                            one_side(side, tree, mp / tree.name, args.workers, rnd,
                                     all_runs[tree.name])
                    else:
                        with mounted(store, mp, other_args, work / "dlfsd-other.log",
                                     args.compare_pythonpath):
                            one_side(side, tree, mp / tree.name, args.workers, rnd,
                                     all_runs[tree.name])

        rows = []
        ratios: dict[tuple[str, str], float] = {}
        for tree in trees:
            runs = all_runs[tree.name]
            for temp in ("cold", "warm"):
                src_fps = runs.files_per_s("source", temp)
                mnt_fps = runs.files_per_s("mount", temp)
                ratio = mnt_fps / src_fps if src_fps else float("nan")
                ratios[(tree.name, temp)] = ratio
                rows.append((f"{tree.label} {temp}", src_fps, runs.mib_per_s("source", temp),
                             mnt_fps, runs.mib_per_s("mount", temp), ratio))
        print_table(("tree / cache", "source files/s", "source MiB/s", "mount files/s",
                     "mount MiB/s", "mount/source"), rows,
                    title=f"medians of {args.rounds} rounds, {args.workers} workers")
        if compare:
            print_compare(trees, all_runs, args.rounds)

        wanted = [("imagenet", "warm", "warm 110 KiB", 0.45), ("bert", "warm", "warm 2.5 KB", 0.15),
                  ("imagenet", "cold", "cold 110 KiB", 0.70)]
        targets = [Target(f"{label} mount/source", ratios[(name, temp)], ">=", goal)
                   for name, temp, label, goal in wanted if (name, temp) in ratios]
        if ("bert", "cold") in ratios:
            print(f"  (cold 2.5 KB mount/source = {ratios[('bert', 'cold')]:.3f}; no target)")
        print_targets(targets, args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

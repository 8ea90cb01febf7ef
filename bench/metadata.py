"""Metadata: directory memory, manifest load, in-process lookups, stat through the mount.

Part 1 (in-process, no mount): a synthetic ImageNet-shaped manifest of
1,000,000 files (1000 class directories "n01440764"-style under train/, each
with 1000 files named like "n01440764_10026.JPEG", lognormal sizes of ~110 KiB
mean, 64 MiB chunks) is built with dlfs.store.directory.build_directory and written
as a real dataset manifest (dlfs.store.store.manifest_body + dlfs.store.format.encode_manifest),
so loading goes through Store.open exactly like the daemon's. No chunk files
are written (nothing reads data here). Reported:

  - directory memory per file: SampleDirectory.nbytes() / files, and the same
    without the name bytes (target: <= 64 B per file + the name bytes)
  - manifest load time, Store(...).open(name), manifest in the page cache
    (target < 2 s, median of --rounds); one load after a cache drop; the RSS
    growth of a fresh process that loads it
  - lookups/s: SampleDirectory.resolve() of random existing paths, and lookup()
    of random (parent row, name) pairs

Part 2 (mount): a 20,000-file tree (generate_tree, small files: stat cost does
not depend on size) is populated and mounted; one pass = os.walk + os.lstat of
every entry. Each round: the source tree (warm pass; and a cold pass after a
cache drop, for information), then a fresh mount's first pass and second pass
(the kernel caches names and attributes for --cache-timeout). Target: mount
first pass <= 2x the warm source pass (stricter than against the cold source;
both ratios are printed).

Part 3 (walk): a cold walk of a tree two ways: listings only (os.walk, getdents,
d_type: a dataset class's file list), and listings with an lstat of every entry
(`ls -lR`, `find -size`, or the opens of a first epoch, which look names up the
same way). Trees
(--walk-trees FILES:PER_DIR,...; default 20,000 files in one directory, and
100,000 files 1000 per directory) are generated and populated once. Each round,
in alternating order, each walk after a cache drop: the source tree, and a
fresh mount (the kernel has no name of it yet) for each walk; with --baseline,
a mount of another DLFS tree's code too. Reported per tree and walk: us per
entry and the mount/source ratio of each round, min/median/max over the
rounds. Target: cold mount walk <= 2x the cold source walk.

Part 4 (lookup): --lookup-procs processes (default 16) look up different names of
one directory of --lookup-files files (default 1000) at once, as DataLoader workers
opening their samples do: process i lstat()s names i, i + P, i + 2P, ..., all
started together, each lookup a LOOKUP request on a fresh mount after a cache
drop. Without FUSE parallel_dirops the kernel holds the directory's lock across
each LOOKUP's round trip, so they go one at a time. Reported: lookups/s from the
first start to the last end, per round for the source, the mount and (--baseline,
--baseline-path) a mount of another checkout's code, min/median/max. References in
the same rounds: --lookup-mirror adds bench/ceiling/mirror.c (C, libfuse) serving the
directory with parallel_dirops ("mirror") and without ("mirror serial");
--lookup-single measures every side with one process too ("SIDE x1"), so that
SIDE / SIDE x1 says what the processes gain over one on this machine's cores.

examples (from the repository root; run as root for cache drops):
  .venv/bin/python bench/metadata.py --quick
  .venv/bin/python bench/metadata.py --parts lookup --rounds 7 --baseline /tmp/e9 \
      --baseline-path /tmp/e9-site --lookup-mirror --lookup-single
  .venv/bin/python bench/metadata.py --parts lookup --rounds 9 --baseline /tmp/e9 \
      --baseline-path /tmp/e9-site   # a checkout of the pyfuse3 days, pyfuse3 there
  .venv/bin/python bench/metadata.py
  .venv/bin/python bench/metadata.py --dirs 10000   # 10 M files
  .venv/bin/python bench/metadata.py --parts walk --rounds 5   # listings only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
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

from dlfs.demo.sampledata import generate_tree, lognormal_sizes
from dlfs.store.directory import SampleDirectory, SourceEntry, build_directory, chunk_lengths
from dlfs.store.format import MANIFEST_NAME, encode_manifest
from dlfs.store.store import Store, manifest_body

DATASET = "imagenet1m"
CHUNK_SIZE = 64 << 20
DIR_MODE = stat.S_IFDIR | 0o755
FILE_MODE = stat.S_IFREG | 0o644


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--dirs", type=int, default=1000,
                   help="class directories in the synthetic manifest (default 1000; "
                        "--quick: 50)")
    p.add_argument("--files-per-dir", type=int, default=1000,
                   help="files per class directory (default 1000)")
    p.add_argument("--lookups", type=int, default=200_000,
                   help="random lookups timed in-process (default 200000; --quick: 10000)")
    p.add_argument("--stat-files", type=int, default=20_000,
                   help="files in the tree stat'ed through the mount (default 20000; "
                        "--quick: 1000)")
    p.add_argument("--parts", default="manifest,stat,walk",
                   help="which parts to run, comma-separated: manifest, stat, walk, lookup "
                        "(default the first three)")
    p.add_argument("--walk-trees", default="20000:20000,100000:1000",
                   help="trees the walk part lists, FILES:FILES_PER_DIR,... (default "
                        "20000:20000 (one directory), 100000:1000; --quick: a twentieth "
                        "of the files)")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help="walk part: also mount with the DLFS code of DIR each round (a "
                        "source tree such as `git archive main | tar -x -C DIR`), for "
                        "before/after ratios of the same run")
    p.add_argument("--baseline-path", metavar="DIR",
                   help="added to PYTHONPATH for the --baseline mount (where an older "
                        "checkout finds its own dependencies, e.g. pyfuse3)")
    p.add_argument("--lookup-files", type=int, default=1000,
                   help="lookup part: files in the one directory (default 1000)")
    p.add_argument("--lookup-procs", type=int, default=16,
                   help="lookup part: processes looking up at once (default 16)")
    p.add_argument("--lookup-mirror", action="store_true",
                   help="lookup part: also bench/ceiling/mirror.c with and without "
                        "parallel_dirops (needs cc and libfuse3-dev)")
    p.add_argument("--lookup-single", action="store_true",
                   help="lookup part: also every side with one process (SIDE x1)")
    p.add_argument("--mount-args", default="",
                   help="extra arguments for `dlfs mount`, e.g. --mount-args='--cache-timeout 1'")
    args = p.parse_args(argv)
    if args.quick:
        args.dirs = max(1, args.dirs // 20)
        args.lookups = max(1, args.lookups // 20)
        args.stat_files = max(1, args.stat_files // 20)
    args.parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    unknown = args.parts - {"manifest", "stat", "walk", "lookup"}
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}")
    try:
        args.walk_trees = [tuple(int(x) for x in tree.split(":")) for tree in
                           args.walk_trees.split(",") if tree]
        if any(len(t) != 2 or min(t) < 1 for t in args.walk_trees):
            raise ValueError
    except ValueError:
        p.error("--walk-trees: FILES:FILES_PER_DIR,... with positive numbers")
    if args.quick:
        args.walk_trees = [(max(1, files // 20), per_dir) for files, per_dir in args.walk_trees]
    return args


# -- part 1: synthetic manifest ------------------------------------------------
def synthetic_entries(dirs: int, per_dir: int, seed: int = 0) -> tuple[list[SourceEntry],
                                                                         list[bytes]]:
    """ImageNet-shaped entries (root, train/, class dirs, files) and the file paths."""
    rng = np.random.default_rng(seed)
    now = time.time_ns()
    wnids = sorted((rng.choice(14_000_000, dirs, replace=False) + 1_000_000).tolist())
    sizes = lognormal_sizes(dirs * per_dir, 110 << 10, 0.5, rng).tolist()
    entries = [SourceEntry(b"", DIR_MODE, 0, now), SourceEntry(b"train", DIR_MODE, 0, now)]
    paths: list[bytes] = []
    k = 0
    for wnid in wnids:
        cls = b"n%08d" % wnid
        base = b"train/" + cls
        entries.append(SourceEntry(base, DIR_MODE, 0, now))
        numbers = rng.choice(max(per_dir * 2, 50_000), per_dir, replace=False).tolist()
        for num in numbers:
            rel = b"%s/%s_%d.JPEG" % (base, cls, num)
            entries.append(SourceEntry(rel, FILE_MODE, sizes[k], now - k * 1000))
            paths.append(rel)
            k += 1
    return entries, paths


def write_manifest(store: Path, directory: SampleDirectory) -> Path:
    kinds = directory.arrays["mode"] & 0o170000
    files = kinds == stat.S_IFREG
    stats = {"files": int(np.count_nonzero(files)),
             "dirs": int(np.count_nonzero(kinds == stat.S_IFDIR)), "symlinks": 0,
             "bytes": int(directory.arrays["size"][files].sum()), "skipped": 0,
             "source": "synthetic (bench/metadata.py)"}
    body = manifest_body(DATASET, uuid.uuid4().bytes, CHUNK_SIZE, chunk_lengths(directory),
                         directory, stats)
    path = store / DATASET / MANIFEST_NAME
    path.parent.mkdir(parents=True)
    path.write_bytes(encode_manifest(body))
    return path


_RSS_PROBE = """
import json, sys
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
from dlfs.store.store import Store
before = rss()
d = Store(sys.argv[1]).open(sys.argv[2])
print(json.dumps({'before': before, 'after': rss(), 'nbytes': d.directory.nbytes()}))
"""


def rss_growth(store: Path) -> int:
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(store), DATASET],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    return data["after"] - data["before"]


def part1(args: argparse.Namespace, work: Path, targets: list[Target]) -> None:
    files = args.dirs * args.files_per_dir
    print(f"\n== part 1: synthetic manifest, {args.dirs:,} dirs x {args.files_per_dir:,} files "
          f"= {files:,} files")
    t0 = time.perf_counter()
    entries, paths = synthetic_entries(args.dirs, args.files_per_dir)
    t1 = time.perf_counter()
    directory = build_directory(entries, CHUNK_SIZE)
    t2 = time.perf_counter()
    del entries
    store = work / "store-meta"
    manifest = write_manifest(store, directory)
    t3 = time.perf_counter()
    del directory
    print(f"  entries {t1 - t0:.1f} s, build_directory {t2 - t1:.1f} s, encode+write "
          f"{t3 - t2:.1f} s; manifest {manifest.stat().st_size / (1 << 20):.1f} MiB")

    loads = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        dataset = Store(store).open(DATASET)
        loads.append(time.perf_counter() - started)
        del dataset
    drop_caches()
    started = time.perf_counter()
    dataset = Store(store).open(DATASET)
    cold_load = time.perf_counter() - started
    d = dataset.directory
    growth = rss_growth(store)

    n_files = int(dataset.stats["files"])
    nbytes = d.nbytes()
    name_bytes = len(d.names)
    per_file = nbytes / n_files
    per_file_no_names = (nbytes - name_bytes) / n_files
    print_table(("directory memory", "value"), [
        ("entries (rows)", len(d)),
        ("extents", d.extent_count),
        ("nbytes() total", f"{nbytes / (1 << 20):.1f} MiB"),
        ("  of which name bytes", f"{name_bytes / (1 << 20):.1f} MiB"),
        ("bytes per file", per_file),
        ("bytes per file without names", per_file_no_names),
        ("name bytes per file", name_bytes / n_files),
        ("RSS growth of a fresh process on load", f"{growth / (1 << 20):.1f} MiB "
                                                  f"({growth / n_files:.0f} B/file)"),
    ])
    print_table(("manifest load (Store.open)", "seconds"), [
        (f"warm page cache, median of {args.rounds}", median(loads)),
        ("warm, all runs", " ".join(f"{x:.3f}" for x in loads)),
        ("after a cache drop", cold_load),
    ])

    # lookups: random existing paths
    rnd = random.Random(0)
    sample = [paths[rnd.randrange(len(paths))] for _ in range(args.lookups)]
    started = time.perf_counter()
    rows = [d.resolve(p) for p in sample]
    resolve_s = time.perf_counter() - started
    if min(rows) < 0:
        raise RuntimeError("resolve() missed an existing path")
    pairs = []
    for p in sample:
        parent, _, name = p.rpartition(b"/")
        pairs.append((d.resolve(parent), name))
    started = time.perf_counter()
    rows2 = [d.lookup(parent, name) for parent, name in pairs]
    lookup_s = time.perf_counter() - started
    if rows2 != rows:
        raise RuntimeError("lookup() and resolve() disagree")
    print_table(("in-process lookups", "per second", "us each"), [
        ("resolve(b'train/<class>/<file>')", len(sample) / resolve_s,
         resolve_s / len(sample) * 1e6),
        ("lookup(parent row, name)", len(pairs) / lookup_s, lookup_s / len(pairs) * 1e6),
    ])
    targets.append(Target("directory bytes per file without names", per_file_no_names,
                          "<=", 64, " B"))
    targets.append(Target(f"manifest load, {n_files:,} files (median)", median(loads), "<", 2.0,
                          " s"))


# -- part 2: stat through the mount ------------------------------------------------
def walk_stat(root: Path) -> tuple[int, float]:
    """os.walk + os.lstat of every entry below root: (entries, seconds)."""
    count = 0
    started = time.perf_counter()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            count += 1
    return count, time.perf_counter() - started


def part2(args: argparse.Namespace, work: Path, targets: list[Target]) -> None:
    print(f"\n== part 2: stat every entry of a {args.stat_files:,}-file tree")
    src = work / "src-stat"
    generate_tree(src, args.stat_files, 2500, seed=2)
    store = work / "store-stat"
    took = populate(src, store, "stat")
    print(f"  populated in {took:.1f} s")
    mp = work / "mnt"
    times: dict[str, list[float]] = {"source warm": [], "source cold": [], "mount 1st": [],
                                     "mount 2nd": []}
    expected = None
    for rnd in range(args.rounds):
        order = ("source", "mount") if rnd % 2 == 0 else ("mount", "source")
        for side in order:
            if side == "source":
                walk_stat(src)  # warm it
                counts = []
                n, s = walk_stat(src)
                times["source warm"].append(s)
                counts.append(n)
                drop_caches()
                n, s = walk_stat(src)
                times["source cold"].append(s)
                counts.append(n)
            else:
                with mounted(store, mp, split_args(args.mount_args), work / "dlfsd.log"):
                    n1, s1 = walk_stat(mp / "stat")
                    n2, s2 = walk_stat(mp / "stat")
                times["mount 1st"].append(s1)
                times["mount 2nd"].append(s2)
                counts = [n1, n2]
            expected = expected or counts[0]
            if any(c != expected for c in counts):
                raise RuntimeError(f"{side} saw {counts} entries, expected {expected}")
        print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-1] * 1000:.1f} ms" for k, v in times.items()), flush=True)

    med = {k: median(v) for k, v in times.items()}
    rows = [(k, expected, v * 1000, expected / v if v else float("nan"),
             v / med["source warm"], v / med["source cold"]) for k, v in med.items()]
    print_table(("pass", "entries", "ms", "entries/s", "x source warm", "x source cold"), rows,
                title=f"medians of {args.rounds} rounds")
    targets.append(Target("stat: mount 1st pass / source warm pass", med["mount 1st"] /
                          med["source warm"], "<=", 2.0, "x"))


# -- part 3: listings (os.walk, no stat) --------------------------------------------
def walk_list(root: Path) -> tuple[int, float]:
    """os.walk of root (the listing only: d_type says what is a directory): (entries,
    seconds)."""
    count = 0
    started = time.perf_counter()
    for _, dirnames, filenames in os.walk(root):
        count += len(dirnames) + len(filenames)
    return count, time.perf_counter() - started


@contextlib.contextmanager
def code_of(tree: Path | None, work: Path, extra_path: str | None = None) -> Iterator[None]:
    """Run `dlfs mount` (and so its daemon) with the packages of source tree `tree`
    (None: this one): PYTHONPATH names links dlfs -> tree/dlfs and dlfsd -> tree/daemon,
    and the working directory is one where no other `dlfs` package can be found."""
    if tree is None:
        yield
        return
    links = work / "baseline-path"
    if not links.exists():
        links.mkdir()
        (links / "dlfs").symlink_to(tree.resolve() / "dlfs")
        (links / "dlfsd").symlink_to(tree.resolve() / "daemon")
    before, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = str(links) + (f":{extra_path}" if extra_path else "")
    os.chdir("/")
    try:
        yield
    finally:
        os.chdir(cwd)
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def part3(args: argparse.Namespace, work: Path, targets: list[Target]) -> None:
    passes = {"list": walk_list, "list+lstat": walk_stat}
    for files, per_dir in args.walk_trees:
        print(f"\n== part 3: walk of {files:,} files, {per_dir:,} per directory: listings "
              "only (list), and listings with an lstat of every entry (list+lstat)")
        name = f"walk{files}"
        src = work / f"src-{name}"
        generate_tree(src, files, 64, files_per_dir=per_dir, seed=3)
        store = work / f"store-{name}"
        took = populate(src, store, name)
        print(f"  populated in {took:.1f} s")
        mp = work / "mnt"
        sides = ["source", "mount"] + (["baseline"] if args.baseline else [])
        times: dict[str, list[float]] = {f"{side} {kind}": [] for side in sides
                                         for kind in passes}
        expected = None
        for rnd in range(args.rounds):
            for side in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
                for kind, walk in passes.items():
                    drop_caches()  # cold: the same start for every side and pass
                    if side == "source":
                        n, took = walk(src)
                    else:  # a fresh mount: the kernel knows no name of it yet
                        with code_of(args.baseline if side == "baseline" else None, work), \
                                mounted(store, mp, split_args(args.mount_args),
                                        work / "dlfsd.log"):
                            n, took = walk(mp / name)
                    times[f"{side} {kind}"].append(took)
                    expected = expected or n
                    if n != expected:
                        raise RuntimeError(f"{side} {kind} saw {n} entries, not {expected}")
            print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1] * 1e6 / expected:.2f}" for k, v in times.items())
                + " us/entry", flush=True)
        rows = []
        for key, values in times.items():
            side, kind = key.split(" ")
            ratios = sorted(t / s for t, s in zip(values, times[f"source {kind}"], strict=True))
            rows.append((key, median(values) * 1e6 / expected, ratios[0], median(ratios),
                         ratios[-1]))
            if side == "mount":
                targets.append(Target(f"{files:,} files, {per_dir:,} per dir, {kind}: cold "
                                      "mount / cold source (median of the rounds' ratios)",
                                      median(ratios), "<=", 2.0, "x"))
        print_table(("walk (cold)", "us/entry (median)", "x source min", "median", "max"), rows,
                    title=f"{files:,} files ({expected:,} entries): {args.rounds} rounds, "
                          "ratios to the source walk of the same round")


# -- part 4: lookups of one directory by many processes at once -------------------------
def _look_up(paths: list[bytes], start, times, index: int) -> None:
    """A lookup process: wait for the start, lstat each path, note when (monotonic)."""
    start.wait()
    began = time.perf_counter()
    for path in paths:
        os.lstat(path)
    times[2 * index], times[2 * index + 1] = began, time.perf_counter()


def look_up_at_once(directory: Path, names: list[str], procs: int) -> float:
    """`procs` processes lstat different names of `directory` at once; lookups/s."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    start, times = ctx.Event(), ctx.Array("d", 2 * procs)
    shares = [[os.fsencode(directory / n) for n in names[i::procs]] for i in range(procs)]
    workers = [ctx.Process(target=_look_up, args=(shares[i], start, times, i))
               for i in range(procs)]
    for w in workers:
        w.start()
    time.sleep(0.2)  # every process waiting
    start.set()
    for w in workers:
        w.join()
    if any(w.exitcode for w in workers):
        raise RuntimeError(f"a lookup process failed in {directory}")
    took = max(times[1::2]) - min(times[0::2])
    return len(names) / took


def part4(args: argparse.Namespace, work: Path, targets: list[Target]) -> None:
    files, procs = args.lookup_files, args.lookup_procs
    print(f"\n== part 4: {procs} processes look up different names of one {files:,}-file "
          "directory at once, cold")
    src = work / "src-lookup"
    generate_tree(src, files, 64, files_per_dir=files, seed=4)
    directory = src / "train" / "c00000"  # generate_tree's first (and only) directory
    rel = directory.relative_to(src)
    names = sorted(p.name for p in directory.iterdir())
    store = work / "store-lookup"
    populate(src, store, "lookup")
    mp = work / "mnt"
    sides = ["source", "mount"] + (["baseline"] if args.baseline else [])
    mirror_argv: dict[str, list[str]] = {}
    if args.lookup_mirror:
        from fuse_ceiling import Unavailable, build_mirror, foreign_mount
        try:
            binary = str(build_mirror(work))
            mirror_argv = {"mirror": [binary, str(directory), str(mp)],
                           "mirror serial": [binary, str(directory), str(mp),
                                             "--serial-dirops"]}
            sides += list(mirror_argv)
        except Unavailable as why:
            print(f"  mirror: unavailable: {why}")
    runs = [(side, n) for side in sides
            for n in ((procs, 1) if args.lookup_single and procs != 1 else (procs,))]
    rates: dict[str, list[float]] = {side if n == procs else f"{side} x1": []
                                     for side, n in runs}
    for rnd in range(args.rounds):
        for side, n in runs[rnd % len(runs):] + runs[:rnd % len(runs)]:
            key = side if n == procs else f"{side} x1"
            mp.mkdir(exist_ok=True)
            if side == "source":
                drop_caches()
                rates[key].append(look_up_at_once(directory, names, n))
                continue
            if side in mirror_argv:
                with foreign_mount(mirror_argv[side], mp):
                    drop_caches()
                    rates[key].append(look_up_at_once(mp, names, n))
                continue
            with code_of(args.baseline if side == "baseline" else None, work,
                         args.baseline_path if side == "baseline" else None), \
                    mounted(store, mp, split_args(args.mount_args), work / "dlfsd.log"):
                drop_caches()
                rates[key].append(look_up_at_once(mp / "lookup" / rel, names, n))
        print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
            f"{side} {r[-1]:,.0f}" for side, r in rates.items()) + " lookups/s", flush=True)
    rows = [(side, min(r), median(r), max(r)) for side, r in rates.items()]
    for side in sides:  # what the processes gain over one, per round
        if f"{side} x1" in rates:
            gain = [a / b for a, b in zip(rates[side], rates[f"{side} x1"], strict=True)]
            rows.append((f"{side} / {side} x1 per round", min(gain), median(gain), max(gain)))
    for side in ("source", "mirror", "mirror serial"):
        if side in rates and side != "source":
            per = [m / s for m, s in zip(rates["mount"], rates[side], strict=True)]
            rows.append((f"mount/{side} per round", min(per), median(per), max(per)))
    if "mirror serial" in rates:
        per = [a / b for a, b in zip(rates["mirror"], rates["mirror serial"], strict=True)]
        rows.append(("mirror/mirror serial per round", min(per), median(per), max(per)))
    if args.baseline:
        per_round = [m / b for m, b in zip(rates["mount"], rates["baseline"], strict=True)]
        rows.append(("mount/baseline per round", min(per_round), median(per_round),
                     max(per_round)))
        targets.append(Target(f"{procs} processes, one {files:,}-file directory: mount / "
                              "baseline lookups/s (median of the rounds' ratios)",
                              median(per_round), ">=", 2.0, "x"))
    print_table(("lookups/s", "min", "median", "max"), rows,
                title=f"{args.rounds} rounds, {procs} processes, {files:,} names")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets: list[Target] = []
    with workdir(args.workdir, args.keep, "metadata") as work:
        if "manifest" in args.parts:
            part1(args, work, targets)
        if "stat" in args.parts:
            part2(args, work, targets)
        if "walk" in args.parts:
            part3(args, work, targets)
        if "lookup" in args.parts:
            part4(args, work, targets)
    print_targets(targets, args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

"""Ten million entries: populate, mount, find, a stat walk, a big listing, an epoch, memory.

Builds a tree of --entries files (default 10,000,000): one directory of
--big-dir files (default 100,000) and the rest in directories of
--files-per-dir (default 1,000). Files are --file-size bytes (default 64)
made sparse (ftruncate: no data blocks, reads as zeros), so 10 M of them cost
inodes, not 40 GB of 4 KiB blocks; populate still reads and packs every byte.
Then, caches dropped before each timed step (`echo 3 > drop_caches`, as root):

  populate   `dlfs populate SRC --store STORE --name ds` (default options)
  mount      `dlfs mount` until it answers (the CLI returns then), cold manifest
  find       `find MP/ds` of a fresh mount vs `find SRC` (no stat: d_type)
  stat walk  `find ROOT -printf '%s %m'` (an lstat of every entry, in C) of a
             fresh mount vs the source
  listing    the --big-dir directory: os.listdir (getdents only) and os.scandir
             + lstat (what `ls -l` does), mount vs source, each after a drop,
             --rounds alternating rounds, min/median/max
  epoch      one shuffled epoch of --epoch-files (default 100,000) files picked
             at random over the whole tree, --workers reader processes, mount
             vs source, cold
  memory     PSS of all the daemon's processes (main, workers, control: the
             sum of Pss in /proc/PID/smaps_rollup), after mount, after the walk,
             after the epoch

Targets (issue 21, item 2): mount < 5 s; daemon PSS < 1.5 GiB; the 100,000-entry
listing through the mount <= 2x the source's cold listing.

examples (from the repository root, as root; 10 M needs ~10 M free inodes):
  .venv/bin/python bench/scale.py --quick                # 500,000 entries
  .venv/bin/python bench/scale.py --entries 1000000
  .venv/bin/python bench/scale.py                       # 10,000,000 entries
  .venv/bin/python bench/scale.py --entries 1000000 --keep --workdir /var/tmp/big
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import subprocess
import time
from pathlib import Path

from _common import (
    Target,
    _daemon_pid,
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
    split_args,
    workdir,
)

from dlfs.demo.workload import shuffled_epoch

BIG_DIR = "big"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--entries", type=int, default=10_000_000,
                   help="files in the tree (default 10000000)")
    p.add_argument("--big-dir", type=int, default=100_000,
                   help="files in the one big directory whose listing is timed (default 100000)")
    p.add_argument("--files-per-dir", type=int, default=1000,
                   help="files per directory elsewhere (default 1000)")
    p.add_argument("--file-size", type=size_arg, default=64,
                   help="bytes per file (default 64; sparse, so no data blocks)")
    p.add_argument("--epoch-files", type=int, default=100_000,
                   help="files read in the random epoch (default 100000)")
    p.add_argument("--workers", type=int, default=2, help="epoch reader processes (default 2)")
    p.add_argument("--populate-args", default="", help="extra `dlfs populate` arguments")
    p.add_argument("--mount-args", default="", help="extra `dlfs mount` arguments")
    p.add_argument("--source", type=Path, default=None,
                   help="build the tree here, or reuse the one a run with the same --entries, "
                        "--big-dir, --files-per-dir and --file-size built there before (it "
                        "is left in place; default: in the work directory, removed after)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="processes that create the tree (default: the cores)")
    args = p.parse_args(argv)
    if args.quick:
        args.entries = max(10_000, args.entries // 20)
        args.big_dir = min(args.big_dir, max(1000, args.entries // 10))
        args.epoch_files = min(args.epoch_files, 10_000)
    args.big_dir = min(args.big_dir, args.entries)
    args.epoch_files = min(args.epoch_files, args.entries)
    return args


# -- the tree ------------------------------------------------------------------------------
def layout(args) -> list[tuple[str, int, int]]:
    """(directory, first file number, files) of the whole tree."""
    dirs = [(BIG_DIR, 0, args.big_dir)]
    for start in range(args.big_dir, args.entries, args.files_per_dir):
        dirs.append((dir_of(start, args), start, min(args.files_per_dir, args.entries - start)))
    return dirs


def dir_of(number: int, args) -> str:
    """The directory layout() put file `number` in."""
    if number < args.big_dir:
        return BIG_DIR
    k = (number - args.big_dir) // args.files_per_dir
    return f"d{k // 1000:04d}/c{k % 1000:03d}"


def file_name(number: int) -> str:
    return f"sample_{number:08d}.bin"


def _make_dirs(job: tuple[str, list[tuple[str, int, int]], int]) -> int:
    root, dirs, size = job
    for rel, first, n in dirs:
        path = os.path.join(root, rel)
        os.makedirs(path, exist_ok=True)
        for i in range(first, first + n):
            fd = os.open(os.path.join(path, file_name(i)), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
    return sum(n for _, _, n in dirs)


def build_tree(root: Path, dirs: list[tuple[str, int, int]], size: int, jobs: int) -> float:
    started = time.monotonic()
    big, rest = dirs[:1], dirs[1:]
    # The big directory split by file ranges, the others whole, dealt round-robin.
    parts = [(BIG_DIR, first, min(10_000, big[0][2] - first))
             for first in range(0, big[0][2], 10_000)] + rest
    jobs_list = [(str(root), parts[j::jobs * 8], size) for j in range(jobs * 8)]
    with mp.get_context("fork").Pool(jobs) as pool:
        made = sum(pool.imap_unordered(_make_dirs, jobs_list))
    assert made == sum(n for _, _, n in dirs)
    return time.monotonic() - started


def ensure_tree(src: Path, dirs: list[tuple[str, int, int]], args) -> float:
    """Build the tree at src unless a finished one of this shape is there already."""
    shape = f"{args.entries} {args.big_dir} {args.files_per_dir} {args.file_size}\n"
    marker = src.with_name(src.name + ".scale-shape")
    if marker.exists() and marker.read_text() == shape and src.is_dir():
        print(f"reusing the tree at {src}")
        return 0.0
    if src.exists() and any(src.iterdir()):
        raise SystemExit(f"scale.py: {src} is not empty and not a tree this run built; "
                         "give an empty or new --source")
    took = build_tree(src, dirs, args.file_size, args.jobs)
    marker.write_text(shape)
    return took


# -- measurements --------------------------------------------------------------------------
def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def find_time(root: Path) -> float:
    return timed(["find", str(root)])


def stat_walk_time(root: Path) -> float:
    return timed(["find", str(root), "-printf", "%s %m\n"])


def list_time(path: Path) -> tuple[float, float]:
    """(os.listdir, os.scandir + lstat of each) seconds; the second after a second drop."""
    drop_caches()
    started = time.perf_counter()
    names = os.listdir(path)
    t_list = time.perf_counter() - started
    drop_caches()
    started = time.perf_counter()
    with os.scandir(path) as it:
        for entry in it:
            entry.stat(follow_symlinks=False)
    t_stat = time.perf_counter() - started
    assert names, f"{path} is empty"
    return t_list, t_stat


def descendants(pid: int) -> list[int]:
    """pid and every process below it (the daemon's workers and control process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rpartition(b")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        p = queue.pop()
        found.append(p)
        queue.extend(children.get(p, []))
    return found


def pss_bytes(mp_path: Path) -> tuple[int, int]:
    """(sum of Pss over the daemon's processes, how many processes)."""
    pid = _daemon_pid(mp_path)
    total, count = 0, 0
    for p in descendants(pid) if pid else []:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        count += 1
                        break
        except OSError:
            continue
    return total, count


def gib(n: float) -> str:
    return f"{n / (1 << 30):.3f} GiB"


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return "/".join(fmt.format(v) for v in (min(values), median(values), max(values)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mount_args = split_args(args.mount_args)
    dirs = layout(args)
    with workdir(args.workdir, args.keep, "scale") as work:
        src, store, mnt = args.source or work / "src", work / "store", work / "mnt"
        t_build = ensure_tree(src, dirs, args)
        print(f"{args.entries:,} files of {args.file_size} bytes in {len(dirs):,} directories "
              f"(one of {args.big_dir:,}); built in {t_build:.1f} s", flush=True)

        drop_caches()
        t_pop = populate(src, store, "ds", split_args(args.populate_args))
        manifest = sum(p.stat().st_size for p in (store / "ds").glob("manifest*"))
        print(f"populate {t_pop:.1f} s ({t_pop / args.entries * 1e6:.0f} us/file); manifest "
              f"{manifest / (1 << 20):.1f} MiB ({manifest / args.entries:.0f} B/file)", flush=True)

        rng = random.Random(1)
        picks = rng.sample(range(args.entries), args.epoch_files)
        epoch_paths = [f"{dir_of(i, args)}/{file_name(i)}" for i in picks]
        nbytes = args.epoch_files * args.file_size

        res: dict[str, list[float]] = {}
        pss: dict[str, int] = {}
        for rnd in range(args.rounds):
            drop_caches()
            started = time.perf_counter()
            with mounted(store, mnt, mount_args, work / "dlfsd.log") as m:
                res.setdefault("mount", []).append(time.perf_counter() - started)
                pss["after mount"] = max(pss.get("after mount", 0), pss_bytes(m)[0])
                if rnd == 0:
                    drop_caches()
                    res["find mount"] = [find_time(m / "ds")]
            print(f"round {rnd + 1}: mount {res['mount'][-1]:.2f} s", flush=True)
        drop_caches()
        res["find source"] = [find_time(src)]
        drop_caches()
        res["walk source"] = [stat_walk_time(src)]
        with mounted(store, mnt, mount_args, work / "dlfsd.log") as m:
            drop_caches()
            res["walk mount"] = [stat_walk_time(m / "ds")]
            pss["after walk"] = pss_bytes(m)[0]
            for rnd in range(args.rounds):
                sides = [("source", src), ("mount", m / "ds")]
                for side, root in sides if rnd % 2 == 0 else reversed(sides):
                    t_list, t_stat = list_time(root / BIG_DIR)
                    res.setdefault(f"list {side}", []).append(t_list)
                    res.setdefault(f"list+stat {side}", []).append(t_stat)
            for rnd in range(args.rounds):
                sides = [("source", src), ("mount", m / "ds")]
                for side, root in sides if rnd % 2 == 0 else reversed(sides):
                    drop_caches()
                    r = shuffled_epoch([str(root / p) for p in epoch_paths], args.workers,
                                       seed=rnd)
                    if r.bytes != nbytes:
                        print(f"WARNING: {side} epoch read {r.bytes} bytes, not {nbytes}")
                    res.setdefault(f"epoch {side}", []).append(r.files_per_s)
            pss["after epoch"], procs = pss_bytes(m)
        print_table(("step", "mount (s)", "source (s)", "mount/source"), [
            ("find (fresh mount, cold)", spread(res["find mount"]), spread(res["find source"]),
             median(res["find mount"]) / median(res["find source"])),
            ("stat walk (cold)", spread(res["walk mount"]), spread(res["walk source"]),
             median(res["walk mount"]) / median(res["walk source"])),
            (f"list {args.big_dir:,}-entry dir (cold)", spread(res["list mount"]),
             spread(res["list source"]),
             median(res["list mount"]) / median(res["list source"])),
            ("  the same + lstat each (cold)", spread(res["list+stat mount"]),
             spread(res["list+stat source"]),
             median(res["list+stat mount"]) / median(res["list+stat source"])),
        ], title=f"{args.entries:,} entries; min/median/max of {args.rounds} round(s) where "
                 "rounds apply")
        print(f"\nmount (cold manifest): {spread(res['mount'])} s")
        print(f"epoch of {args.epoch_files:,} random files (cold), files/s: mount "
              f"{spread(res['epoch mount'], '{:,.0f}')}, source "
              f"{spread(res['epoch source'], '{:,.0f}')}; "
              f"mount/source {median(res['epoch mount']) / median(res['epoch source']):.3f}")
        print("daemon PSS (" + f"{procs} processes): " + ", ".join(f"{k} {gib(v)}"
                                                                 for k, v in pss.items()))
        print(f"populate {t_pop:.1f} s; tree built in {t_build:.1f} s")
        print_targets([
            Target("mount seconds (median)", median(res["mount"]), "<", 5.0),
            Target("daemon PSS GiB (max seen)", max(pss.values()) / (1 << 30), "<", 1.5),
            Target("cold listing mount/source", median(res["list mount"])
                   / median(res["list source"]), "<=", 2.0),
        ], args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

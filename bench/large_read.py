"""Large sequential reads: DLFS mount vs the source directory, cold.

4 files of 146 MiB (dlfs.demo.sampledata.generate_large_files, Unet3D-like volumes)
are packed with `dlfs populate` and mounted. One read = one process reading
a file start to end in --block-size reads (default 1 MiB, readinto a reused
buffer) right after dropping the page cache.

This VM's disk speed drifts by 2-3x within seconds (the host's cache), so
source and mount are paired finely: for every file, each round makes a fresh
`dlfs mount` (checksums are verified again and chunks prefetched again, as on
a real first read) and reads the file twice, once from the source and once
through the mount, back to back (which goes first alternates), each after a
cache drop. The figure is the median of the per-pair ratios mount/source over
all files and rounds; the MiB/s are medians of the single reads.

Target (from the issue): cold mount/source >= 0.85.

--node-local: the files are read from node-local copies, as a job's later epochs
read them (issue 32: large files by FUSE passthrough). Each --variant is one
`dlfs mount --cache-dir` (default: `passthrough`, the default mount, which
serves the files by FUSE passthrough from verified whole-file copies where it
may; `daemon`, `--passthrough off`, today's reads of staged chunks through the
daemon), all mounted at once and fully staged (chunks and whole-file copies
checked) before the first read. Each round then reads the files --readers at a
time (one process per file, started together) from the source and through each
variant, each after a cache drop, in an order that rotates; a ratio compares a
variant's group with the source's group of the same round. The daemons keep
what they verified across rounds (a long job's steady state).
Target (issue 32): node-local by passthrough >= 0.95 x local, 1 and 2 readers.

examples (from the repository root; run as root for cache drops):
  .venv/bin/python bench/large_read.py --quick
  .venv/bin/python bench/large_read.py
  .venv/bin/python bench/large_read.py --mount-args='--workers 1'   # one worker process
  .venv/bin/python bench/large_read.py --pipe-max-size 2M   # as root with CAP_SYS_RESOURCE
  .venv/bin/python bench/large_read.py --mount-args='--no-splice'
  .venv/bin/python bench/large_read.py --file-size 1G --block-size 4M
  .venv/bin/python bench/large_read.py --node-local --readers 1 --rounds 5
  .venv/bin/python bench/large_read.py --node-local --readers 2 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import time
from pathlib import Path

from _common import (
    Target,
    add_common_args,
    drop_caches,
    formatter,
    median,
    mounted,
    pipe_max_size,
    populate,
    print_table,
    print_targets,
    read_ahead_kb,
    run_main,
    size_arg,
    splice_state,
    split_args,
    workdir,
)

from dlfs.demo.sampledata import generate_large_files


def add_file_args(p: argparse.ArgumentParser) -> None:
    """--files, --file-size and --mount-args (shared with bench/fuse_ceiling.py)."""
    p.add_argument("--files", type=int, default=4, help="number of large files (default 4)")
    p.add_argument("--file-size", type=size_arg, default=146 << 20,
                   help="size of each file, e.g. 146M (default; --quick: 1/20 of it)")
    p.add_argument("--mount-args", default="",
                   help="extra arguments for `dlfs mount`, e.g. --mount-args='--no-verify'")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    add_file_args(p)
    p.add_argument("--block-size", type=size_arg, default=1 << 20,
                   help="read size (default 1M)")
    p.add_argument("--read-ahead-kb", type=int, default=None,
                   help="set the mount's kernel read-ahead (/sys/class/bdi/DEV/read_ahead_kb) "
                        "after mounting; default: leave what `dlfs mount` set (its "
                        "--read-ahead-kb, 4096; the FUSE kernel default is 128)")
    p.add_argument("--pipe-max-size", type=size_arg, default=None, metavar="SIZE",
                   help="raise fs.pipe-max-size to SIZE during the run (e.g. 2M) and restore "
                        "it: lets a daemon without CAP_SYS_RESOURCE splice 1 MiB reads, as "
                        "root on a real node does (default: leave it)")
    p.add_argument("--populate-args", default="",
                   help="extra arguments for `dlfs populate`, e.g. --populate-args='-j 4'")
    p.add_argument("--node-local", action="store_true",
                   help="read from node-local copies (mounts with --cache-dir, staged "
                        "first); see above")
    p.add_argument("--readers", type=int, default=1,
                   help="--node-local: files read at once, one process each (default 1)")
    p.add_argument("--variant", action="append", metavar="NAME=ARGS",
                   help="--node-local: a mount to measure, NAME=extra `dlfs mount` args "
                        "(repeatable; default: passthrough= and 'daemon=--passthrough off')")
    args = p.parse_args(argv)
    if args.quick:
        args.file_size = max(1, args.file_size // 20)
    return args


def read_sequential(paths: list[Path], block: int) -> tuple[int, float]:
    """Read each file whole, in order; (bytes, seconds)."""
    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with pipe_max_size(args.pipe_max_size):
        return measure_node_local(args) if args.node_local else measure(args)


def _read_one(path: str, block: int, nbytes, index: int) -> None:
    """A reader process: one file whole; its byte count into `nbytes[index]`."""
    nbytes[index] = read_sequential([Path(path)], block)[0]


def read_parallel(paths: list[Path], block: int) -> tuple[int, float]:
    """Read each file whole, one process per file, all started together; (bytes, seconds
    from the first start to the last end)."""
    ctx = multiprocessing.get_context("fork")
    counts = ctx.Array("q", len(paths))
    procs = [ctx.Process(target=_read_one, args=(str(p), block, counts, i))
             for i, p in enumerate(paths)]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    took = time.perf_counter() - started
    if any(proc.exitcode for proc in procs):
        raise RuntimeError(f"a reader of {paths} failed")
    return sum(counts), took


def wait_node_local(mountpoint: Path, timeout: float = 1800.0) -> dict:
    """Block until the mount staged every owned chunk and verified every whole-file copy
    it keeps; returns its status."""
    from _pool import status

    deadline = time.monotonic() + timeout
    while True:
        s = status(mountpoint)
        chunks = all(d["staging"]["staged_chunks"] == d["staging"]["owned_chunks"]
                     for d in s["datasets"])
        pt = s.get("passthrough", {})
        if chunks and pt.get("verified_copies", 0) == pt.get("large_files", 0):
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mountpoint} was not staged in {timeout:.0f} s")
        time.sleep(0.2)


def measure_node_local(args: argparse.Namespace) -> int:
    """--node-local: every variant mounted and staged, then grouped cold reads (see the
    module doc)."""
    variants = [v.partition("=")[::2] for v in
                (args.variant or ["passthrough=", "daemon=--passthrough off"])]
    with workdir(args.workdir, args.keep, "large-read") as work, contextlib.ExitStack() as stack:
        src, store = work / "src", work / "store"
        summary = generate_large_files(src, args.files, args.file_size, seed=3)
        took = populate(src, store, "volumes", split_args(args.populate_args))
        names = [p.name for p in summary.paths]
        groups = [names[i:i + args.readers] for i in range(0, len(names), args.readers)]
        print(f"{args.files} files x {args.file_size / (1 << 20):.1f} MiB; populate {took:.1f} "
              f"s; block {args.block_size} B; {args.readers} reader(s) at a time, "
              f"{len(groups)} group(s) per round; node-local copies")
        mounts = {}
        for name, extra in variants:
            mp = work / f"mnt-{name}"
            mounts[name] = stack.enter_context(mounted(
                store, mp, ["--cache-dir", str(work / f"cache-{name}"), *split_args(extra)],
                work / f"dlfsd-{name}.log"))
            state = wait_node_local(mp)
            print(f"  {name} ({extra or 'default'}): staged; passthrough "
                  f"{state.get('passthrough', {}).get('mode')}")
        sides = ["source", *mounts]
        speeds: dict[str, list[float]] = {side: [] for side in sides}
        ratios: dict[str, list[float]] = {name: [] for name in mounts}
        for rnd in range(args.rounds):
            for g, group in enumerate(groups):
                shift = (rnd + g) % len(sides)
                pair = {}
                for side in sides[shift:] + sides[:shift]:
                    base = src if side == "source" else mounts[side] / "volumes"
                    drop_caches()
                    nbytes, secs = read_parallel([base / n for n in group], args.block_size)
                    want = sum((src / n).stat().st_size for n in group)
                    if nbytes != want:
                        raise RuntimeError(f"{side} read {nbytes} bytes of {group}, "
                                           f"expected {want}")
                    pair[side] = nbytes / (1 << 20) / secs
                    speeds[side].append(pair[side])
                for name in mounts:
                    ratios[name].append(pair[name] / pair["source"])
            print(f"  round {rnd + 1}/{args.rounds}: " + "; ".join(
                f"{side} {' '.join(f'{x:,.0f}' for x in speeds[side][-len(groups):])}"
                for side in sides) + " MiB/s", flush=True)
        rows = [(f"{side} MiB/s", median(speeds[side]),
                 f"{min(speeds[side]):,.0f}-{max(speeds[side]):,.0f}") for side in sides]
        rows += [(f"{name}/source per group", median(r), f"{min(r):.3f}-{max(r):.3f}")
                 for name, r in ratios.items()]
        print_table(("cold node-local read", "median", "spread (min-max)"), rows,
                    title=f"{len(groups) * args.rounds} groups of {args.readers} "
                          f"({args.rounds} rounds)")
        targets = [Target(f"cold node-local {name}/source, {args.readers} reader(s)",
                          median(r), ">=", 0.95) for name, r in ratios.items()
                   if name == "passthrough"]
        print_targets(targets, args.quick)
    return 0


def measure(args: argparse.Namespace) -> int:
    mount_args = split_args(args.mount_args)
    with workdir(args.workdir, args.keep, "large-read") as work:
        src = work / "src"
        store = work / "store"
        mp = work / "mnt"
        summary = generate_large_files(src, args.files, args.file_size, seed=3)
        took = populate(src, store, "volumes", split_args(args.populate_args))
        print(f"{args.files} files x {args.file_size / (1 << 20):.1f} MiB "
              f"({summary.bytes / (1 << 20):.1f} MiB); populate {took:.1f} s; "
              f"block {args.block_size} B; mount args: {mount_args or '(default)'}")
        print(f"splice: {splice_state()}")
        names = [p.name for p in summary.paths]
        sizes = [p.stat().st_size for p in summary.paths]
        speeds: dict[str, list[float]] = {"source": [], "mount": []}
        ratios: list[float] = []
        ra = None
        for rnd in range(args.rounds):
            for i, name in enumerate(names):
                # A fresh mount per pair: nothing the daemon did for an earlier file
                # (checked extents, chunks already prefetched, then dropped) carries over.
                with mounted(store, mp, mount_args, work / "dlfsd.log"):
                    ra = read_ahead_kb(mp, args.read_ahead_kb)
                    pair = {}
                    sides = ("source", "mount") if (rnd + i) % 2 == 0 else ("mount", "source")
                    for side in sides:
                        path = src / name if side == "source" else mp / "volumes" / name
                        drop_caches()
                        nbytes, secs = read_sequential([path], args.block_size)
                        if nbytes != sizes[i]:
                            raise RuntimeError(f"{side} read {nbytes} bytes of {name}, "
                                               f"expected {sizes[i]}")
                        pair[side] = nbytes / (1 << 20) / secs
                        speeds[side].append(pair[side])
                    ratios.append(pair["mount"] / pair["source"])
            last = slice(-len(names), None)
            print(f"  round {rnd + 1}/{args.rounds}: source "
                  f"{' '.join(f'{x:,.0f}' for x in speeds['source'][last])} MiB/s, mount "
                  f"{' '.join(f'{x:,.0f}' for x in speeds['mount'][last])} MiB/s (mount "
                  f"read_ahead_kb {ra}, source {read_ahead_kb(src)})", flush=True)

        ratio = median(ratios)
        print_table(("cold sequential read", "median", "spread (min-max)"), [
            ("source MiB/s", median(speeds["source"]),
             f"{min(speeds['source']):,.0f}-{max(speeds['source']):,.0f}"),
            ("mount MiB/s", median(speeds["mount"]),
             f"{min(speeds['mount']):,.0f}-{max(speeds['mount']):,.0f}"),
            ("mount/source per pair", ratio, f"{min(ratios):.2f}-{max(ratios):.2f}"),
        ], title=f"{len(ratios)} pairs ({args.rounds} rounds x {len(names)} files)")
        print_targets([Target("cold large read mount/source", ratio, ">=", 0.85)], args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

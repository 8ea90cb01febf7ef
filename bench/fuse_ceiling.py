"""Large cold reads: DLFS next to the best a FUSE file system can do on this machine.

bench/large_read.py misses its target (cold mount/source >= 0.85) on the 2-vCPU CI
VM. This bench says whether any FUSE daemon could reach it here, by reading the
same files, cold, through reference mirrors of the source directory that do
nothing DLFS does (no chunks, no checksums, no Python on the read path):

  source               the files read directly (the baseline of every ratio)
  dlfs                 `dlfs mount` of the packed files, as in bench/large_read.py
  mirror               bench/ceiling/mirror.c: the leanest multithreaded libfuse
                       daemon, read = pread() + reply (built here with cc)
  passthrough          bench/ceiling/passthrough.py: FUSE passthrough, the kernel
                       reads the source files itself (Linux >= 6.9, root)
  passthrough+verify   the same, hashing each file whole at open first: what
                       passthrough costs if no unverified byte may reach a reader

Pairing as in bench/large_read.py: for every file, each round reads it once per
system, each read after a cache drop and through a fresh mount, in an order that
rotates; a ratio compares a read with the source read of the same file in the
same round. Figures: medians over files and rounds.

Small files (--small-files N): the bound for bench/random_read.py's cold 110 KiB
figure (--workers 1: dlfs >= 0.70 x source). N files of ~110 KiB (lognormal, as
random_read's tree) in one directory, read whole, cold, in a shuffled order by
--readers processes (default 1), one epoch per system per round: source, dlfs, and
mirror run with --no-open (the kernel opens files itself, as with DLFS: a file
costs a LOOKUP and its READs, no OPEN). Each system's epoch follows a cache drop
and a fresh mount, in an order that rotates; the ratio compares it with the source
epoch of the same round; figures: min/median/max of the rounds' ratios. --also
MOUNT_ARGS (repeatable) adds a dlfs mount with those arguments ("dlfs[ARGS]") to
the same rounds, to try a change against the same reference.

examples (from the repository root, as root):
  .venv/bin/python bench/fuse_ceiling.py --quick
  .venv/bin/python bench/fuse_ceiling.py --rounds 5
  .venv/bin/python bench/fuse_ceiling.py --small-files 2000 --rounds 7
  .venv/bin/python bench/fuse_ceiling.py --small-files 2000 --also='--no-splice'
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from _common import (
    add_common_args,
    drop_caches,
    formatter,
    median,
    mounted,
    populate,
    print_table,
    run_main,
    split_args,
    workdir,
)
from large_read import add_file_args, read_sequential

from dlfs.demo.sampledata import generate_large_files, generate_tree
from dlfs.demo.workload import shuffled_epoch

HERE = Path(__file__).resolve().parent / "ceiling"
MOUNT_WAIT = 10.0  # seconds a reference mirror may take to mount


class Unavailable(Exception):
    """A reference system cannot run here (no compiler, no passthrough, ...)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    add_file_args(p)
    p.add_argument("--small-files", type=int, default=0, metavar="N",
                   help="small-file mode: N files of ~110 KiB in one directory, read "
                        "whole by --readers processes (default 0: the large-file mode; "
                        "--quick: N/20)")
    p.add_argument("--readers", type=int, default=1,
                   help="small-file mode: reader processes (default 1)")
    p.add_argument("--also", action="append", default=[], metavar="MOUNT_ARGS",
                   help="small-file mode: also a dlfs mount with these `dlfs mount` "
                        "arguments, in the same rounds (repeatable; note the '=')")
    args = p.parse_args(argv)
    if args.quick:
        args.file_size = max(1, args.file_size // 20)
        args.small_files = max(1, args.small_files // 20) if args.small_files else 0
    return args


def build_mirror(work: Path) -> Path:
    """Compile bench/ceiling/mirror.c into `work`; Unavailable with the reason if not."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise Unavailable("no C compiler (apt install gcc)")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"],
                           capture_output=True, text=True)
    if flags.returncode != 0:
        raise Unavailable("pkg-config finds no fuse3 (apt install libfuse3-dev pkg-config)")
    binary = work / "mirror"
    built = subprocess.run([cc, "-O2", "-o", str(binary), str(HERE / "mirror.c"),
                            *flags.stdout.split()], capture_output=True, text=True)
    if built.returncode != 0:
        raise Unavailable(f"cc failed: {built.stderr.strip().splitlines()[-1:]}")
    return binary


@contextlib.contextmanager
def foreign_mount(argv: list[str], mountpoint: Path) -> Iterator[None]:
    """Run a reference mirror in the foreground until it answers at `mountpoint`; unmount
    and reap it afterwards, also when the read failed. Unavailable if it cannot mount or
    a read through it fails (e.g. the kernel refused a passthrough open)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    failed: OSError | None = None
    try:
        _wait_answering(proc, mountpoint)
        try:
            yield
        except OSError as err:
            failed = err
    finally:
        said = _stop(proc, mountpoint)
    if failed is not None:
        raise Unavailable(f"{failed}; {said}" if said else str(failed))


def _wait_answering(proc: subprocess.Popen, mountpoint: Path) -> None:
    """Until the mountpoint is a mount that answers (ismount stats it: a mount whose
    daemon refused INIT says ENOTCONN, so it is no mount to ismount)."""
    deadline = time.monotonic() + MOUNT_WAIT
    while not os.path.ismount(mountpoint):
        if proc.poll() is not None:
            raise Unavailable(proc.stderr.read().strip() or f"exited {proc.returncode}")
        if time.monotonic() > deadline:
            raise Unavailable(f"not mounted after {MOUNT_WAIT:.0f} s")
        time.sleep(0.01)


def _stop(proc: subprocess.Popen, mountpoint: Path) -> str:
    """Unmount (lazily if it must: a dead mirror leaves an ENOTCONN mount), reap the
    mirror, and return what it said on stderr."""
    if subprocess.run(["fusermount3", "-u", str(mountpoint)],
                      capture_output=True).returncode != 0:
        subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    said = proc.stderr.read().strip()
    proc.stderr.close()
    return said


def systems(args: argparse.Namespace, work: Path, store: Path,
            src: Path) -> dict[str, Callable[[Path], contextlib.AbstractContextManager]]:
    """Name -> a context manager factory that mounts that system at a mountpoint."""
    found: dict[str, Callable[[Path], contextlib.AbstractContextManager]] = {
        "dlfs": lambda mp: mounted(store, mp, split_args(args.mount_args),
                                   work / "dlfsd.log"),
    }
    try:
        binary = build_mirror(work)
        found["mirror"] = lambda mp: foreign_mount([str(binary), str(src), str(mp)], mp)
    except Unavailable as why:
        print(f"mirror: unavailable: {why}")
    passthrough = [sys.executable, str(HERE / "passthrough.py"), str(src)]
    found["passthrough"] = lambda mp: foreign_mount([*passthrough, str(mp)], mp)
    found["passthrough+verify"] = lambda mp: foreign_mount(
        [*passthrough, str(mp), "--verify"], mp)
    return found


SMALL_MEAN = 110 << 10  # bench/random_read.py's ImageNet-like tree


def measure_small(args: argparse.Namespace) -> int:
    with workdir(args.workdir, args.keep, "fuse-ceiling-small") as work:
        src, store, mp = work / "src", work / "store", work / "mnt"
        mp.mkdir()
        summary = generate_tree(src, args.small_files, SMALL_MEAN,
                                files_per_dir=args.small_files, seed=1)
        flat = summary.paths[0].parent  # generate_tree's one directory
        names = [p.name for p in summary.paths]
        rel = flat.relative_to(src)
        populate(src, store, "small")
        mounts: dict[str, Callable[[Path], contextlib.AbstractContextManager]] = {
            "dlfs": lambda mp: mounted(store, mp, split_args(args.mount_args),
                                       work / "dlfsd.log")}
        for extra in args.also:
            mounts[f"dlfs[{extra}]"] = lambda mp, extra=extra: mounted(
                store, mp, [*split_args(args.mount_args), *split_args(extra)],
                work / "dlfsd-also.log")
        try:
            binary = build_mirror(work)
            mounts["mirror"] = lambda mp: foreign_mount(
                [str(binary), str(flat), str(mp), "--no-open"], mp)
        except Unavailable as why:
            print(f"mirror: unavailable: {why}")
        prefix = {"source": flat, "mirror": mp}
        print(f"{len(names)} files, {summary.bytes / (1 << 20):.1f} MiB (mean "
              f"{summary.bytes / len(names) / 1024:.1f} KiB), one directory, cold, "
              f"{args.readers} reader(s), shuffled, whole files; dlfs mount args: "
              f"{args.mount_args or '(default)'}; systems: source, {', '.join(mounts)}")
        rates: dict[str, list[float]] = {name: [] for name in ("source", *mounts)}
        for rnd in range(args.rounds):
            order = list(rates)
            k = rnd % len(order)
            got: dict[str, float] = {}
            for system in order[k:] + order[:k]:
                if system != "source" and system not in mounts:
                    continue  # found unavailable earlier in this run
                base = prefix.get(system, mp / "small" / rel)
                paths = [str(base / n) for n in names]
                try:
                    with (contextlib.nullcontext() if system == "source"
                          else mounts[system](mp)):
                        drop_caches()
                        epoch = shuffled_epoch(paths, args.readers, seed=rnd)
                except Unavailable as why:
                    print(f"{system}: unavailable: {why}")
                    del mounts[system]
                    continue
                if epoch.bytes != summary.bytes:
                    raise RuntimeError(f"{system} read {epoch.bytes} bytes, expected "
                                       f"{summary.bytes}")
                got[system] = epoch.files_per_s
            for system, fps in got.items():
                rates[system].append(fps / got["source"] if system != "source" else fps)
            print(f"  round {rnd + 1}/{args.rounds}: source {got['source']:,.0f} files/s; "
                  + ", ".join(f"{s} {v / got['source']:.3f}" for s, v in got.items()
                              if s != "source") + " x source", flush=True)
        rows = [("source files/s", min(rates["source"]), median(rates["source"]),
                 max(rates["source"]))]
        rows += [(f"{s} / source", min(r), median(r), max(r)) for s, r in rates.items()
                 if s != "source" and r]
        if rates.get("mirror") and len(rates["mirror"]) == len(rates["dlfs"]):
            per = [d / m for d, m in zip(rates["dlfs"], rates["mirror"], strict=True)]
            rows.append(("dlfs / mirror", min(per), median(per), max(per)))
        print_table(("cold small files", "min", "median", "max"), rows,
                    title=f"{args.rounds} rounds; ratios of the same round")
        print("\nreading: bench/random_read.py's target is cold 110 KiB dlfs >= 0.70 x "
              "source. mirror (C, no checksums, no OPEN) bounds any FUSE daemon that "
              "answers LOOKUP and READ itself: where it stays below 0.70 too, the target "
              "is beyond FUSE on this machine.")
    return 0


def measure(args: argparse.Namespace) -> int:
    if args.small_files:
        return measure_small(args)
    with workdir(args.workdir, args.keep, "fuse-ceiling") as work:
        src, store, mp = work / "src", work / "store", work / "mnt"
        mp.mkdir()
        summary = generate_large_files(src, args.files, args.file_size, seed=3)
        populate(src, store, "volumes")
        names = [p.name for p in summary.paths]
        size = args.file_size
        mounts = systems(args, work, store, src)
        print(f"{args.files} files x {size / (1 << 20):.1f} MiB, cold, 1 MiB reads; "
              f"systems: source, {', '.join(mounts)}")
        speeds: dict[str, list[float]] = {name: [] for name in ("source", *mounts)}
        ratios: dict[str, list[float]] = {name: [] for name in mounts}
        for rnd in range(args.rounds):
            for i, name in enumerate(names):
                order = list(speeds)
                k = (rnd * len(names) + i) % len(order)
                got = {}
                for system in order[k:] + order[:k]:
                    if system != "source" and system not in mounts:
                        continue  # found unavailable earlier in this run
                    path = src / name if system == "source" else (
                        mp / "volumes" / name if system == "dlfs" else mp / name)
                    try:
                        with (contextlib.nullcontext() if system == "source"
                              else mounts[system](mp)):
                            drop_caches()
                            nbytes, secs = read_sequential([path], 1 << 20)
                    except Unavailable as why:
                        print(f"{system}: unavailable: {why}")
                        del mounts[system]
                        continue
                    if nbytes != size:
                        raise RuntimeError(f"{system} read {nbytes} bytes of {name}, "
                                           f"expected {size}")
                    got[system] = nbytes / (1 << 20) / secs
                    speeds[system].append(got[system])
                for system, mib_s in got.items():
                    if system != "source":
                        ratios[system].append(mib_s / got["source"])
            print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{s} {median(v[-len(names):]):,.0f}" for s, v in speeds.items() if v)
                + " MiB/s (medians of the round)", flush=True)
        rows = [("source", median(speeds["source"]), 1.0, "")]
        rows += [(s, median(speeds[s]), median(r), f"{min(r):.2f}-{max(r):.2f}")
                 for s, r in ratios.items() if r]
        print_table(("system", "MiB/s", "x source", "spread (min-max)"), rows,
                    title=f"medians of {args.rounds} rounds x {len(names)} files")
        print("\nreading: bench/large_read.py's target is dlfs >= 0.85 x source. Where "
              "mirror (no checksums, C) stays below it too, no FUSE daemon that answers "
              "reads itself reaches it on this machine; passthrough+verify is the "
              "bound for a daemon that must check every byte before a reader sees it.")
    return 0


def main(argv: list[str] | None = None) -> int:
    return measure(parse_args(argv))


if __name__ == "__main__":
    run_main(main)

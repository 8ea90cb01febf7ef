"""What showing the checkpoint store in MOUNTPOINT/ckpt/ costs, and restart reads.

Two mounts with their own --cache-dir and one --ckpt-store ("node A" and "node B")
over one small dataset; each round measures, through real FUSE mounts:

  miss     stat() of --names names missing in ckpt/ on A: each is one LOOKUP (the
           kernel caches no miss), which asks the local tree and then the store
  create   --names new files of 4 KiB created, written and closed on A (torch.save's
           pattern: a LOOKUP that misses, CREATE, WRITE, RELEASE)
  adopt    after A flushed them, the first listing (os.scandir + stat) of that
           directory on B: each file adopted as a placeholder
  list     the same listing again on B: one store lstat per placeholder
  read     --size bytes written and flushed on A, read back on B (from the store's
           copy, each 4 MiB extent checked against the drain's sums) and on A (its
           local copy), MiB/s; and a second such file whose sums were removed
           (DIR/.dlfs-sums), read unchecked on B: "checked / unchecked" is the ratio
           of the two reads on B, per round (the two are read in alternating order)

The store is a directory on the same disk here, so a store lstat costs what a local
one does (microseconds); on a parallel file system each is a metadata round trip.
--write-only measures `miss` and `create` alone: what runs on code before the union
too (check out its daemon/ckpt/ to compare).

--in-process times CkptTree.lookup itself, without FUSE (a Tier and a CkptTree in
this process, as a worker has them), --names calls each per round: a name missing
here and on the store; a file written here and not drained; a drained file (a copy
of the store's, checked against it). The FUSE round trip and the kernel are out of
it, so the difference between code versions shows above the noise of a shared VM.

examples (from the repository root, as root):
  .venv/bin/python bench/ckpt_restart.py --quick
  .venv/bin/python bench/ckpt_restart.py --rounds 5 --names 2000 --size 512M
  .venv/bin/python bench/ckpt_restart.py --rounds 5 --write-only
  .venv/bin/python bench/ckpt_restart.py --rounds 5 --in-process --names 20000
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path

from _common import (
    add_common_args,
    formatter,
    median,
    mounted,
    populate,
    print_table,
    run_dlfs,
    run_main,
    size_arg,
    sync,
    workdir,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--names", type=int, default=1000,
                   help="names looked up / files created and listed (default 1000)")
    p.add_argument("--size", type=size_arg, default=256 << 20,
                   help="bytes of the checkpoint read back (default 256M)")
    p.add_argument("--in-process", action="store_true",
                   help="time CkptTree.lookup in this process (no FUSE)")
    p.add_argument("--write-only", action="store_true",
                   help="only `miss` and `create` (they run on code before the union too)")
    args = p.parse_args(argv)
    if args.quick:
        args.names = min(args.names, 200)
        args.size = min(args.size, 32 << 20)
    return args


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def stat_missing(ck: Path, count: int, tag: str) -> None:
    for i in range(count):
        try:
            os.stat(ck / f"missing-{tag}-{i}")
        except FileNotFoundError:
            continue
        raise AssertionError("a missing name exists")


def create_files(directory: Path, count: int) -> None:
    data = os.urandom(4096)
    for i in range(count):
        with open(directory / f"f{i}", "wb") as f:
            f.write(data)


def listing(directory: Path) -> int:
    n = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            entry.stat(follow_symlinks=False)
            n += 1
    return n


def read_all(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            n += len(chunk)
    return n


def one_round(work: Path, args, rnd: int, res: dict[str, list[float]]) -> None:
    store = work / "ckstore" / f"r{rnd}"
    mount_a = ["--cache-dir", str(work / f"cache-a{rnd}"), "--ckpt-store", str(store)]
    mount_b = ["--cache-dir", str(work / f"cache-b{rnd}"), "--ckpt-store", str(store)]
    with mounted(work / "store", work / "mnt-a", mount_a, work / "a.log") as a, \
            mounted(work / "store", work / "mnt-b", mount_b, work / "b.log") as b:
        ca, cb = a / "ckpt", b / "ckpt"
        names = args.names
        res["miss (us/lookup)"].append(
            timed(lambda: stat_missing(ca, names, str(rnd))) / names * 1e6)
        (ca / "many").mkdir()
        res["create (files/s)"].append(names / timed(lambda: create_files(ca / "many", names)))
        if args.write_only:
            return
        run_dlfs(["flush", str(a), "--quiet"])
        assert listing(cb / "many") == names  # B sees A's files
        (ca / "many2").mkdir()  # a directory B has not listed yet
        create_files(ca / "many2", names)
        run_dlfs(["flush", str(a), "--quiet"])
        res["adopt (files/s)"].append(names / timed(lambda: listing(cb / "many2")))
        res["list (files/s)"].append(names / timed(lambda: listing(cb / "many2")))

        block = os.urandom(4 << 20)
        for name in ("model.pt", "unchecked.pt"):
            with open(ca / name, "wb") as f:
                for _ in range(args.size // len(block)):
                    f.write(block)
        run_dlfs(["flush", str(a), "--quiet"])
        st = os.lstat(store / "unchecked.pt")
        os.unlink(store / ".dlfs-sums" / f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}")
        sync()
        reads = [("B, from the store", cb, "model.pt"), ("B, unchecked", cb, "unchecked.pt")]
        if rnd % 2:
            reads.reverse()
        seconds = {}
        for where, ck, name in [*reads, ("A, local copy", ca, "model.pt")]:
            seconds[where] = timed(lambda ck=ck, name=name: read_all(ck / name))
            res[f"read on {where} (MiB/s)"].append(args.size / seconds[where] / (1 << 20))
        res["checked / unchecked (read time on B)"].append(
            seconds["B, from the store"] / seconds["B, unchecked"])


def in_process_round(work: Path, names: int, rnd: int, res: dict[str, list[float]]) -> None:
    from dlfsd.ckpt.drain import Drainer, scan
    from dlfsd.ckpt.tier import Tier
    from dlfsd.ckpt.tree import CkptTree

    (work / f"ckstore{rnd}").mkdir()  # as `dlfs mount` makes it: the tier creates no store
    tier = Tier(str(work / f"cache{rnd}"), str(work / f"ckstore{rnd}"))
    try:
        tree = CkptTree(tier)
        root = tree.root_nodeid
        written = tree.create(root, b"written", 0, 0o644)
        tree.release(written.ino)
        drained = tree.create(root, b"drained", 0, 0o644)
        tree.write(drained.ino, 0, b"x" * 4096)
        tree.release(drained.ino)
        drainer = Drainer(tier, jobs=1)
        drainer.start()
        try:
            deadline = time.monotonic() + 30
            while tier.state.drained_at(drained.ino & ~(1 << 63)) is None \
                    or tier.state.is_pending(drained.ino & ~(1 << 63)):
                if time.monotonic() > deadline:
                    raise RuntimeError("the drain did not finish")
                time.sleep(0.05)
        finally:
            drainer.stop()
        tree.open(written.ino, os.O_WRONLY)  # pending again: written here, not drained
        scan(tier)

        def lookups(name: bytes, found: bool) -> None:
            for _ in range(names):
                try:
                    tree.lookup(root, name)
                except Exception:
                    if found:
                        raise
                else:
                    if not found:
                        raise AssertionError(name)

        for label, name, found in (("missing here and on the store", b"missing", False),
                                   ("a file written here, not drained", b"written", True),
                                   ("a drained file (a copy)", b"drained", True)):
            res[f"lookup: {label} (us)"].append(
                timed(lambda n=name, f=found: lookups(n, f)) / names * 1e6)
    finally:
        tier.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.in_process:
        with workdir(args.workdir, args.keep, "ckpt-restart") as work:
            res: dict[str, list[float]] = defaultdict(list)
            for rnd in range(args.rounds):
                in_process_round(work, args.names, rnd, res)
            rows = [(k, min(v), median(v), max(v)) for k, v in res.items()]
            print_table(["CkptTree.lookup", "min", "median", "max"], rows,
                        title=f"{args.rounds} rounds of {args.names} calls, no FUSE")
        return 0
    with workdir(args.workdir, args.keep, "ckpt-restart") as work:
        source = work / "src"
        source.mkdir()
        (source / "f").write_bytes(b"sample")
        populate(source, work / "store", "ds")
        res: dict[str, list[float]] = {}
        for key in ("miss (us/lookup)", "create (files/s)", "adopt (files/s)",
                    "list (files/s)", "read on B, from the store (MiB/s)",
                    "read on B, unchecked (MiB/s)", "checked / unchecked (read time on B)",
                    "read on A, local copy (MiB/s)"):
            res[key] = []
        for rnd in range(args.rounds):
            one_round(work, args, rnd, res)
        rows = [(k, min(v), median(v), max(v)) for k, v in res.items() if v]
        print_table(["measure", "min", "median", "max"], rows,
                    title=f"{args.rounds} rounds, {args.names} names, "
                          f"{args.size >> 20} MiB read back")
    return 0


if __name__ == "__main__":
    run_main(main)

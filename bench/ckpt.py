"""Checkpoint writes through MOUNTPOINT/ckpt/ vs a local directory and a throttled store.

One mount per round with --cache-dir and --ckpt-store (drained at --drain-bandwidth,
default 200 MiB/s: the bench's PFS model, as bench/staging.py paces store reads).
Each writer writes one checkpoint of --size bytes and closes it; the time until it
returns is the time the training loop is blocked:

  block   a plain writer: 4 MiB write() calls, then close
  torch   torch.save of a dict of 64 MiB float32 tensors (skipped without torch)

each to three places, in alternating order per round (`sync` before each):

  local   a directory on the cache disk (what NVMe alone costs)
  pfs     a directory on the same disk written through a file object that paces
          every write to --store-rate (a store taking 200 MiB/s)
  mount   MOUNTPOINT/ckpt/ (absorbed in the node cache, drained in the background),
          with FUSE passthrough where the daemon gets it (root, Linux >= 6.9, the
          default there: the kernel writes the local copy itself)
  served  MOUNTPOINT/ckpt/ again, on a second mount per round with passthrough off
          (DLFS_CKPT_PASSTHROUGH=0: every write() is a WRITE request to the daemon);
          --no-served skips it

After the mount's write, `dlfs flush` times the drain (close -> on the store):
drain rate = size / that time, against `cp` of the local write's file to a store
dir right after that write, with the same rate limit (cp time = max(cp's own time
+ sync, size / rate)): both copies start while their source is still being
written back (here the cache disk and the store are one disk). Then, on the
same mount, a training-like epoch (bench/staging.py's shuffled reader over a staged
dataset of 110 KiB files) runs on a quiet node, right after a checkpoint written
to the local dir (its writeback runs), and right after one written through the
mount (its writeback and its drain run): files/s during a drain / files/s after
the local write is what the drain costs reads; and once more on a mount of the
same cache without --ckpt-store (what the checkpoint connection costs dataset reads:
nothing is expected, it is a FUSE connection of its own).

Targets (issue 22):
  mount / local write time                 <= 1.5 (mount: the default, see served)
  pfs / mount write time                   >= 3
  drain rate / cp rate (same throttle)     >= 0.8
  reads during a drain / after a local write  >= 0.9

--drain-only measures the drain alone against cp (a synced file, no FUSE): what the
drain costs where the cache disk and the store are separate devices.

--reads-only measures only what the drain costs dataset reads, each condition over
--window seconds of epochs back to back (one epoch alone is too short on this VM).

examples (from the repository root, as root):
  .venv/bin/python bench/ckpt.py --quick
  .venv/bin/python bench/ckpt.py --size 2G --rounds 3
  .venv/bin/python bench/ckpt.py --drain-only --size 2G --rounds 3
  .venv/bin/python bench/ckpt.py --reads-only --size 2G --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from _common import (
    Target,
    add_common_args,
    formatter,
    median,
    mounted,
    populate,
    print_table,
    print_targets,
    run_dlfs,
    run_main,
    size_arg,
    sync,
    workdir,
)
from _pool import wait_staged

from dlfs.demo.sampledata import generate_tree
from dlfs.demo.workload import shuffled_epoch

BLOCK = 4 << 20
TENSOR = 64 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--size", type=size_arg, default=2 << 30,
                   help="checkpoint size (default 2G; --quick 256M)")
    p.add_argument("--store-rate", type=size_arg, default=200 << 20,
                   help="the modelled store's write rate, and --drain-bandwidth "
                        "(default 200M)")
    p.add_argument("--files", type=int, default=2000,
                   help="files of the read-side dataset (default 2000; --quick 400)")
    p.add_argument("--readers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--mount-args", default="", help="extra `dlfs mount` arguments")
    p.add_argument("--no-served", dest="served", action="store_false",
                   help="skip the writes through a mount without passthrough")
    p.add_argument("--drain-only", action="store_true",
                   help="only the drain against cp, in this process, of a file already on "
                        "disk (no FUSE, no writeback of the local copy competing)")
    p.add_argument("--reads-only", action="store_true",
                   help="only what a drain costs dataset reads, over --window seconds of "
                        "epochs per condition")
    p.add_argument("--window", type=float, default=6.0,
                   help="seconds of reads per condition with --reads-only (default 6; the "
                        "drain of --size at --store-rate must outlast it)")
    args = p.parse_args(argv)
    if args.quick:
        args.size = min(args.size, 256 << 20)
        args.files = min(args.files, 400)
    return args


class PacedFile:
    """A file whose writes take at least n / rate seconds (the store model)."""

    def __init__(self, path: Path, rate: int) -> None:
        self.f = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.rate = rate
        self.started = time.monotonic()
        self.written = 0

    def write(self, data) -> int:
        n = self.f.write(data)
        self.written += n
        delay = self.started + self.written / self.rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return n

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def write_blocks(f, size: int, block: bytes) -> None:
    left = size
    while left > 0:
        n = min(left, len(block))
        f.write(block[:n] if n < len(block) else block)
        left -= n


def tensors(size: int):
    import torch

    g = torch.Generator().manual_seed(0)
    count = max(1, size // TENSOR)
    return {f"layer{i}.weight": torch.rand(TENSOR // 4, generator=g) for i in range(count)}


def timed_write(kind: str, where: str, path: Path, size: int, rate: int, block: bytes,
                state) -> float:
    sync()
    started = time.monotonic()
    f = PacedFile(path, rate) if where == "pfs" else open(path, "wb")  # noqa: SIM115
    try:
        if kind == "block":
            write_blocks(f, size, block)
        else:
            import torch

            torch.save(state, f)
    finally:
        f.close()
    return time.monotonic() - started


def flush_seconds(mp: Path) -> float:
    started = time.monotonic()
    run_dlfs(["flush", str(mp), "--quiet"])
    return time.monotonic() - started


def cp_seconds(source: Path, target_dir: Path, rate: int,
               settled: bool = True) -> tuple[float, float]:
    """(cp + sync seconds, the same under the rate limit); `settled`: sync first (the
    source's writeback is not cp's), else cp starts while it runs, as the drain does."""
    target_dir.mkdir(parents=True, exist_ok=True)
    if settled:
        sync()
    started = time.monotonic()
    subprocess.run(["cp", str(source), str(target_dir / source.name)], check=True)
    sync()
    took = time.monotonic() - started
    nbytes = source.stat().st_size
    shutil.rmtree(target_dir, ignore_errors=True)
    return took, max(took, nbytes / rate)


def epoch_files_per_s(mp: Path, paths: list[str], readers: int, seed: int) -> float:
    r = shuffled_epoch([str(mp / "ds" / p) for p in paths], readers, seed=seed)
    return len(paths) / r.seconds


def files_per_s_for(mp: Path, paths: list[str], readers: int, seconds: float,
                    seed: int) -> float:
    """Files/s of shuffled epochs run back to back for `seconds` of wall time (the
    clock of each epoch only: its readers' start is not counted)."""
    files, took = 0, 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        r = shuffled_epoch([str(mp / "ds" / p) for p in paths], readers, seed=seed)
        files, took, seed = files + r.files, took + r.seconds, seed + 1
    return files / took


def daemon_cpu_seconds(mp: Path) -> float:
    """CPU seconds (user + system, all threads) the mount's main daemon process has
    used: the drain runs there. Kernel writeback (kworkers) is not in it."""
    pid = json.loads(run_dlfs(["status", str(mp), "--json"]).stdout)["pid"]
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def queued(mp: Path) -> int:
    out = run_dlfs(["status", str(mp), "--json"]).stdout
    return json.loads(out)["ckpt"]["queued_files"]


def one_round(work: Path, args, kinds, paths, rnd: int, res: dict) -> None:
    block = os.urandom(BLOCK)
    mount_args = ["--cache-dir", str(work / "cache"), "--ckpt-store", str(work / "ckstore"),
                  "--drain-bandwidth", str(args.store_rate), *args.mount_args.split()]
    with mounted(work / "store", work / "mnt", mount_args, work / "dlfsd.log") as mp:
        wait_staged(mp)
        places = {"local": work / "local", "pfs": work / "pfs", "mount": mp / "ckpt"}
        for place in places.values():
            place.mkdir(exist_ok=True)
        for kind in kinds:
            state = tensors(args.size) if kind == "torch" else None
            nbytes = args.size
            order = ["local", "pfs", "mount"] if rnd % 2 == 0 else ["mount", "pfs", "local"]
            for where in order:
                path = places[where] / f"{kind}.ckpt"
                took = timed_write(kind, where, path, args.size, args.store_rate, block, state)
                res.setdefault(f"{kind}-{where}", []).append(took)
                line = f"  {kind:5} {where:5} write {took:7.3f} s"
                if where == "mount":
                    nbytes = path.stat().st_size
                    drained = flush_seconds(mp)
                    res.setdefault(f"{kind}-drain", []).append(nbytes / drained)
                    line += f"; drain {drained:6.2f} s ({nbytes / drained / 2**20:6.1f} MiB/s)"
                elif where == "local":  # cp right after the write, as the drain runs
                    t_cp, t_cp_paced = cp_seconds(path, work / "cp-target", args.store_rate,
                                                  settled=False)
                    res.setdefault(f"{kind}-cp", []).append(path.stat().st_size / t_cp_paced)
                    line += (f"; cp + sync {t_cp:5.2f} s, throttled "
                             f"{path.stat().st_size / t_cp_paced / 2**20:6.1f} MiB/s")
                print(line, flush=True)
                path.unlink()  # through the mount: the store's copy goes too
        # training-like reads: on a quiet node; right after a checkpoint written to the
        # local dir (its writeback runs, nothing drains); right after one written
        # through the mount (its writeback and its drain run). After a warm-up epoch;
        # the order of the last two alternates by round.
        epoch_files_per_s(mp, paths, args.readers, 1000 + rnd)
        quiet = epoch_files_per_s(mp, paths, args.readers, rnd)

        def reads_after(where: str) -> tuple[float, int]:
            path = places[where] / "during.ckpt"
            timed_write("block", where, path, args.size, args.store_rate, block, None)
            files_per_s = epoch_files_per_s(mp, paths, args.readers, rnd + 100)
            still = queued(mp) if where == "mount" else 0
            flush_seconds(mp)
            path.unlink()
            sync()
            return files_per_s, still

        if rnd % 2 == 0:
            alone, _ = reads_after("local")
            during, still = reads_after("mount")
        else:
            during, still = reads_after("mount")
            alone, _ = reads_after("local")
        res.setdefault("reads-quiet", []).append(quiet)
        res.setdefault("reads-alone", []).append(alone)
        res.setdefault("reads-during", []).append(during)
        print(f"  reads: quiet {quiet:7.0f} files/s; after a local checkpoint write "
              f"{alone:7.0f}; during a drain {during:7.0f} "
              f"({'drain still running at the end' if still else 'DRAIN ENDED FIRST'})",
              flush=True)
    if args.served:
        served_writes(work, args, kinds, mount_args, block, res)
    # the same epoch on a mount without a checkpoint tier (the checkpoint connection is
    # apart from the datasets': their reads should not notice it)
    plain_args = ["--cache-dir", str(work / "cache"), *args.mount_args.split()]
    with mounted(work / "store", work / "mnt", plain_args, work / "dlfsd.log") as mp:
        wait_staged(mp)
        epoch_files_per_s(mp, paths, args.readers, 1000 + rnd)
        plain = epoch_files_per_s(mp, paths, args.readers, rnd)
    res.setdefault("reads-plain", []).append(plain)
    print(f"  reads on a mount without ckpt/ {plain:7.0f} files/s", flush=True)


def served_writes(work: Path, args, kinds, mount_args: list[str], block: bytes,
                  res: dict) -> None:
    """The same writes and drains through a mount with passthrough off: each write()
    reaches the daemon as WRITE requests (what non-root daemons and old kernels get)."""
    os.environ["DLFS_CKPT_PASSTHROUGH"] = "0"  # the daemon inherits it from `dlfs mount`
    try:
        with mounted(work / "store", work / "mnt", mount_args, work / "dlfsd.log") as mp:
            for kind in kinds:
                state = tensors(args.size) if kind == "torch" else None
                path = mp / "ckpt" / f"{kind}.ckpt"
                took = timed_write(kind, "mount", path, args.size, args.store_rate, block,
                                   state)
                nbytes = path.stat().st_size
                drained = flush_seconds(mp)
                res.setdefault(f"{kind}-served", []).append(took)
                res.setdefault(f"{kind}-served-drain", []).append(nbytes / drained)
                print(f"  {kind:5} served write {took:7.3f} s; drain {drained:6.2f} s "
                      f"({nbytes / drained / 2**20:6.1f} MiB/s)", flush=True)
                path.unlink()
    finally:
        del os.environ["DLFS_CKPT_PASSTHROUGH"]


def summary(values: list[float]) -> str:
    return f"{min(values):.3f} / {median(values):.3f} / {max(values):.3f}"


def drain_only(work: Path, args) -> int:
    """The drain (dlfsd.ckpt.drain.Drainer, as the daemon runs it) of one synced file vs
    `cp` + sync of it, unpaced and paced; rounds alternate which goes first."""
    from dlfsd.ckpt.drain import Drainer, scan
    from dlfsd.ckpt.tier import Tier

    (work / "ckstore").mkdir()
    tier = Tier(str(work / "cache"), str(work / "ckstore"))
    block = os.urandom(BLOCK)
    with open(tier.tree / "f.bin", "wb") as f:
        write_blocks(f, args.size, block)
    sync()
    res: dict[str, list[float]] = {}

    def drain(rate: int) -> float:
        for name in os.listdir(work / "ckstore"):
            os.unlink(work / "ckstore" / name)
        tier.state.db().execute("DELETE FROM drained")
        sync()
        scan(tier, force=True)
        drainer = Drainer(tier, jobs=2, bandwidth=rate)
        started = time.monotonic()
        drainer.start()
        while tier.state.pending_rows():
            time.sleep(0.01)
        took = time.monotonic() - started
        drainer.stop()
        return took

    for rnd in range(args.rounds):
        for rate in (0, args.store_rate):
            label = "unpaced" if not rate else f"{args.store_rate >> 20} MiB/s"
            runs = ["drain", "cp"] if rnd % 2 == 0 else ["cp", "drain"]
            for run in runs:
                if run == "drain":
                    took = drain(rate)
                else:
                    took = max(cp_seconds(tier.tree / "f.bin", work / "cp", 1 << 60)[0],
                               args.size / rate if rate else 0.0)
                res.setdefault(f"{run} {label}", []).append(args.size / took / 2**20)
                print(f"  {run:5} {label:10} {args.size / took / 2**20:8.1f} MiB/s", flush=True)
    rows = [(k + " (MiB/s)", summary(v)) for k, v in res.items()]
    print_table(("measure", "min / median / max"), rows, title=f"{args.rounds} rounds")
    label = f"{args.store_rate >> 20} MiB/s"
    print_targets([Target("drain / cp, paced", median(res[f"drain {label}"])
                          / median(res[f"cp {label}"]), ">=", 0.8),
                   Target("drain / cp, unpaced", median(res["drain unpaced"])
                          / median(res["cp unpaced"]), ">=", 0.8)], args.quick)
    tier.close()
    return 0


class PacedCopy(threading.Thread):
    """A plain buffered copy of `source` into `target` at `rate` (what `cp` to the
    modelled store does, paced like the drain), in a thread that measures its own CPU."""

    def __init__(self, source: Path, target: Path, rate: int) -> None:
        super().__init__(daemon=True)
        self.source, self.target, self.rate = source, target, rate
        self.cpu = self.elapsed = 0.0

    def run(self) -> None:
        started, wall = time.thread_time(), time.monotonic()
        with open(self.source, "rb") as src:
            out = PacedFile(self.target, self.rate)
            try:
                while block := src.read(BLOCK):
                    out.write(block)
                out.flush()
                os.fsync(out.f.fileno())
            finally:
                out.close()
        self.cpu, self.elapsed = time.thread_time() - started, time.monotonic() - wall


def reads_only(work: Path, args, paths: list[str]) -> int:
    """What a drain costs training-like reads, with windows long enough to be told
    from this VM's noise (one epoch of 2,000 files takes ~0.5 s and moved 1.5x between
    runs): per round, files/s over --window seconds of back-to-back epochs on a quiet
    node, right after a local checkpoint write (its writeback runs), and right after
    one written through the mount (its writeback and its drain run; the drain must
    outlast the window); and, the bound, right after a local write while a plain
    buffered copy of it to the store dir runs at the same rate (what any copy tool
    costs the reads on this node). The order of the four alternates by round."""
    block = os.urandom(BLOCK)
    mount_args = ["--cache-dir", str(work / "cache"), "--ckpt-store", str(work / "ckstore"),
                  "--drain-bandwidth", str(args.store_rate), *args.mount_args.split()]
    res: dict[str, list[float]] = {"quiet": [], "local": [], "drain": [], "copy": []}
    share: list[float] = []  # of all CPUs, the daemon's (the drain's) during the window
    copy_share: list[float] = []  # of all CPUs, the plain copy's
    with mounted(work / "store", work / "mnt", mount_args, work / "dlfsd.log") as mp:
        wait_staged(mp)
        (work / "local").mkdir(exist_ok=True)
        places = {"local": work / "local", "drain": mp / "ckpt", "copy": work / "local"}
        (work / "ckstore").mkdir(exist_ok=True)
        files_per_s_for(mp, paths, args.readers, 2, 999)  # warm-up
        for rnd in range(args.rounds):
            order = ["quiet", "local", "drain", "copy"]
            order = order if rnd % 2 == 0 else order[::-1]
            line = []
            for what in order:
                path = None
                if what != "quiet":
                    path = places[what] / "during.ckpt"
                    timed_write("block", what, path, args.size, args.store_rate, block, None)
                copy = None
                if what == "copy":
                    copy = PacedCopy(path, work / "ckstore" / "copy.ckpt", args.store_rate)
                    copy.start()
                cpu, started = daemon_cpu_seconds(mp), time.monotonic()
                rate = files_per_s_for(mp, paths, args.readers, args.window, rnd * 100)
                note = ""
                if copy is not None:
                    if not copy.is_alive():
                        note = " (COPY ENDED FIRST)"
                    copy.join()
                    copy_share.append(copy.cpu / (copy.elapsed * (os.cpu_count() or 1)))
                    note += f" (copy CPU {copy_share[-1]:.1%} of all CPUs)"
                    (work / "ckstore" / "copy.ckpt").unlink()
                if what == "drain":
                    share.append((daemon_cpu_seconds(mp) - cpu)
                                 / ((time.monotonic() - started) * (os.cpu_count() or 1)))
                    note = f" (daemon CPU {share[-1]:.1%} of all CPUs)"
                    if not queued(mp):
                        note += " (DRAIN ENDED FIRST)"
                res[what].append(rate)
                line.append(f"{what} {rate:7.0f}{note}")
                if path is not None:
                    flush_seconds(mp)
                    path.unlink()
                sync()
            print(f"round {rnd + 1}/{args.rounds}: files/s " + "; ".join(line), flush=True)
    print_table(("measure", "min / median / max"),
                [(f"reads {what} (files/s)", summary(v)) for what, v in res.items()],
                title=f"{args.rounds} rounds")
    ratios = [d / a for d, a in zip(res["drain"], res["local"], strict=True)]
    print(f"during a drain / after a local write, per round: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"the daemon's CPU share during the drain windows (a bound: readers that use "
          f"every CPU lose at least that much): {summary(share)}")
    print(f"a plain copy's CPU share, same rate (over its whole run): "
          f"{summary(copy_share)}")
    print(f"during a plain copy / after a local write, per round: "
          f"{', '.join(f'{c / a:.3f}' for c, a in zip(res['copy'], res['local'], strict=True))}")
    print(f"during a drain / quiet, per round: "
          f"{', '.join(f'{d / q:.3f}' for d, q in zip(res['drain'], res['quiet'], strict=True))}")
    print_targets([Target("reads during a drain / after a local checkpoint write",
                          median(res["drain"]) / median(res["local"]), ">=", 0.9),
                   Target("reads during a drain / quiet",
                          median(res["drain"]) / median(res["quiet"]), ">=", 0.9),
                   Target("reads during a drain / during a plain copy (the bound)",
                          median(res["drain"]) / median(res["copy"]), ">=", 0.9)], args.quick)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.drain_only:
        with workdir(args.workdir, args.keep, "ckpt-drain") as work:
            return drain_only(work, args)
    if args.reads_only:
        with workdir(args.workdir, args.keep, "ckpt-reads") as work:
            tree = generate_tree(work / "src", args.files, 110 << 10, seed=1)
            paths = [str(p.relative_to(work / "src")) for p in tree.paths]
            populate(work / "src", work / "store", "ds", ["--chunk-size", "16M", "--no-fsync"])
            print(f"checkpoint {args.size / 2**20:,.0f} MiB drained at "
                  f"{args.store_rate / 2**20:.0f} MiB/s; reads: {args.files} files of 110 KiB, "
                  f"{args.readers} readers, {args.window:.0f} s windows")
            return reads_only(work, args, paths)
    kinds = ["block"]
    try:
        import torch  # noqa: F401

        kinds.append("torch")
    except ImportError:
        print("torch not installed: the torch.save writer is skipped")
    with workdir(args.workdir, args.keep, "ckpt") as work:
        tree = generate_tree(work / "src", args.files, 110 << 10, seed=1)
        paths = [str(p.relative_to(work / "src")) for p in tree.paths]
        populate(work / "src", work / "store", "ds", ["--chunk-size", "16M", "--no-fsync"])
        print(f"checkpoint {args.size / 2**20:,.0f} MiB; store model {args.store_rate / 2**20:.0f}"
              f" MiB/s; reads: {args.files} files of 110 KiB, {args.readers} readers")
        res: dict[str, list[float]] = {}
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}", flush=True)
            one_round(work, args, kinds, paths, rnd, res)
        rows, targets = [], []
        for kind in kinds:
            local, pfs, mount = (res[f"{kind}-{w}"] for w in ("local", "pfs", "mount"))
            drain, cp = res[f"{kind}-drain"], res[f"{kind}-cp"]
            rows += [(f"{kind} write local (s)", summary(local)),
                     (f"{kind} write pfs model (s)", summary(pfs)),
                     (f"{kind} write mount (s)", summary(mount)),
                     *([(f"{kind} write mount, no passthrough (s)",
                         summary(res[f"{kind}-served"]))] if args.served else []),
                     (f"{kind} drain (MiB/s)", summary([v / 2**20 for v in drain])),
                     (f"{kind} cp throttled (MiB/s)", summary([v / 2**20 for v in cp]))]
            targets += [
                Target(f"{kind}: mount / local write time", median(mount) / median(local),
                       "<=", 1.5),
                Target(f"{kind}: pfs / mount write time", median(pfs) / median(mount), ">=", 3),
                Target(f"{kind}: drain rate / cp rate", median(drain) / median(cp), ">=", 0.8),
            ]
            if args.served:
                print(f"{kind}: write through the mount without / with passthrough = "
                      f"{median(res[f'{kind}-served']) / median(mount):.3f}; without "
                      f"passthrough / local = "
                      f"{median(res[f'{kind}-served']) / median(local):.3f}")
        rows += [("reads, mount without ckpt/ (files/s)", summary(res["reads-plain"])),
                 ("reads, quiet (files/s)", summary(res["reads-quiet"])),
                 ("reads after a local write (files/s)", summary(res["reads-alone"])),
                 ("reads during drain (files/s)", summary(res["reads-during"]))]
        targets.append(Target("reads during a drain / after a local checkpoint write",
                              median(res["reads-during"]) / median(res["reads-alone"]),
                              ">=", 0.9))
        print(f"dataset reads on a mount with ckpt/ / without = "
              f"{median(res['reads-quiet']) / median(res['reads-plain']):.3f}")
        print(f"reads during a drain / quiet: "
              f"{median(res['reads-during']) / median(res['reads-quiet']):.3f}")
        print_table(("measure", "min / median / max"), rows,
                    title=f"{args.rounds} rounds")
        print_targets(targets, args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

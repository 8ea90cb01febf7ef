"""`dlfs warmup` vs `cp -r` of the same chunk files, store unthrottled.

One dataset of ~110 KiB files, packed; per round, with dropped caches before
each side and the order flipping every round:

  cp       `cp -r` of the dataset's chunk files into a scratch dir, then sync
  warmup   `dlfs warmup` of a pool of one (it stages every chunk: copied in the
           kernel, fsynced, read back, every extent checked, renamed), then sync
  checked  the reference for the warm-up's own work done the plainest way: each
           chunk file copied in the kernel (copy_file_range), fsynced, read
           back and hashed whole (xxh3-64), one file after another

The warm-up's rate is its stager's own (bytes copied / its time from the first
copy to the last, as bench/staging.py reports the daemon's), and the end-to-end
time of the command (Python start, manifest load: a fixed ~0.5 s here) is shown
beside it. Target (issue #20): warmup rate / cp rate >= 0.8. The `checked`
reference shows what durability and the check cost by themselves: warmup /
checked near 1 says the rest of the gap to cp is that work, not the stager.

examples (from the repository root, as root):
  .venv/bin/python bench/warmup.py --quick
  .venv/bin/python bench/warmup.py --files 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import xxhash
from _common import (
    Target,
    add_common_args,
    drop_caches,
    formatter,
    populate,
    print_targets,
    run_dlfs,
    run_main,
    sync,
    workdir,
)

from dlfs.demo.sampledata import generate_tree


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--files", type=int, default=8000, help="files (default 8000; --quick 2000)")
    p.add_argument("--chunk-size", default="64M", help="populate --chunk-size (default 64M)")
    p.add_argument("--jobs", type=int, default=4, help="warmup --jobs (default 4)")
    args = p.parse_args(argv)
    if args.quick:
        args.files //= 4
    return args


def copy_fsync_and_hash(src: Path, dst: Path) -> int:
    """The reference: copy in the kernel, fsync, read back and hash; returns the hash."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        left = os.fstat(fin.fileno()).st_size
        while left:
            n = os.copy_file_range(fin.fileno(), fout.fileno(), min(left, 1 << 30))
            if n == 0:
                break
            left -= n
        fout.flush()
        os.fsync(fout.fileno())
    digest = xxhash.xxh3_64()
    with open(dst, "rb") as back:
        for block in iter(lambda: back.read(4 << 20), b""):
            digest.update(block)
    return digest.intdigest()


def timed(step) -> float:
    drop_caches()
    started = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with workdir(args.workdir, args.keep, "dlfs-warmup-") as work:
        generate_tree(work / "src", args.files, 110 * 1024)
        populate(work / "src", work / "store", "ds", ["--chunk-size", args.chunk_size])
        chunks = work / "store" / "ds" / "chunks"
        nbytes = sum(p.stat().st_size for p in chunks.iterdir())
        print(f"{args.files} files; {nbytes / (1 << 20):.0f} MiB of chunk files")

        def cp() -> None:
            shutil.rmtree(work / "cp", ignore_errors=True)
            subprocess.run(["cp", "-r", str(chunks), str(work / "cp")], check=True)

        def checked() -> None:
            shutil.rmtree(work / "checked", ignore_errors=True)
            (work / "checked").mkdir()
            for path in sorted(chunks.iterdir()):
                copy_fsync_and_hash(path, work / "checked" / path.name)

        stager_s: list[float] = []

        def warmup() -> None:
            shutil.rmtree(work / "cache", ignore_errors=True)
            out = run_dlfs(["warmup", "--store", str(work / "store"), "--cache-dir",
                            str(work / "cache"), "--jobs", str(args.jobs)]).stdout
            stager_s.append(float(re.search(r"copied in ([\d.]+) s", out).group(1)))

        ratios, against_checked = [], []
        steps = (("cp", cp), ("warmup", warmup), ("checked", checked))
        for r in range(args.rounds):
            times = {}
            for name, step in steps[r % 3:] + steps[:r % 3]:
                times[name] = timed(step)
            ratios.append(times["cp"] / stager_s[-1])
            against_checked.append(times["checked"] / stager_s[-1])
            print(f"  round {r}: checked (copy, fsync, read back, hash) {times['checked']:.2f} s"
                  f" ({nbytes / times['checked'] / 2**20:.0f} MiB/s); warmup rate / checked "
                  f"rate {against_checked[-1]:.3f}", flush=True)
            print(f"  round {r}: cp {times['cp']:.2f} s ({nbytes / times['cp'] / 2**20:.0f} "
                  f"MiB/s); warmup's stager {stager_s[-1]:.2f} s "
                  f"({nbytes / stager_s[-1] / 2**20:.0f} MiB/s), the command with sync "
                  f"{times['warmup']:.2f} s; rate ratio {ratios[-1]:.3f} (end to end "
                  f"{times['cp'] / times['warmup']:.3f})", flush=True)
        ratios.sort()
        against_checked.sort()
        print(f"warmup rate / cp rate: min {ratios[0]:.3f} median "
              f"{ratios[len(ratios) // 2]:.3f} max {ratios[-1]:.3f}")
        print(f"warmup rate / checked rate (the reference): min {against_checked[0]:.3f} "
              f"median {against_checked[len(against_checked) // 2]:.3f} max "
              f"{against_checked[-1]:.3f}")
    print_targets([Target("warmup rate / cp rate", ratios[len(ratios) // 2], ">=", 0.8)],
                  args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

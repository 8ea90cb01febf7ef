"""--replicas 2 staging: secondaries copying from their primaries vs from the store.

One dataset of ~110 KiB files, a pool of --nodes daemons over loopback, the
store paced to --store-bandwidth per stream (a parallel file system gives each
stream a bounded rate). Per round, with fresh cache dirs and dropped caches,
the order flipping every round:

  store     --replica-wait 0: every owner copies each of its chunks from the
            store (how staging worked before): the store serves R copies
  primary   the default: a chunk's first owner copies it from the store, the
            others from it over the pool

Measured: the time from the first `dlfs mount` until every node has staged
its share, and the bytes the stagers read from the store (the daemons'
counters for `primary`; the owned bytes of every node for `store`, where
every staged byte came from the store).

examples (from the repository root, as root):
  .venv/bin/python bench/replicas.py --quick
  .venv/bin/python bench/replicas.py --files 4000 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time
from pathlib import Path

from _common import (
    add_common_args,
    drop_caches,
    formatter,
    mounted,
    populate,
    run_main,
    size_arg,
    workdir,
)
from _pool import free_ports, status, wait_staged, write_secret

from dlfs.demo.sampledata import generate_tree


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--files", type=int, default=4000, help="files (default 4000; --quick 1000)")
    p.add_argument("--nodes", type=int, default=3, help="daemons of the pool (default 3)")
    p.add_argument("--store-bandwidth", type=size_arg, default=50 << 20,
                   help="per-stream store rate (default 50M)")
    p.add_argument("--chunk-size", default="16M", help="populate --chunk-size (default 16M)")
    args = p.parse_args(argv)
    if args.quick:
        args.files = max(200, args.files // 4)
    return args


def stage(work: Path, args, wait: str, tag: str) -> tuple[float, int]:
    """Mount every node, time until all staged; (seconds, bytes read from the store)."""
    names = [f"n{i + 1}" for i in range(args.nodes)]
    nodes = ",".join(f"{n}=127.0.0.1:{p}" for n, p in zip(names, free_ports(args.nodes),
                                                           strict=True))
    secret = write_secret(work / f"secret-{tag}")
    for name in names:
        shutil.rmtree(work / f"cache-{name}", ignore_errors=True)
    drop_caches()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        mps = [stack.enter_context(mounted(
            work / "store", work / f"mnt-{name}",
            ["--cache-dir", str(work / f"cache-{name}"), "--nodes", nodes, "--node", name,
             "--secret-file", str(secret), "--replicas", "2", "--replica-wait", wait,
             "--store-bandwidth", str(args.store_bandwidth)], work / f"dlfsd-{tag}-{name}.log"))
            for name in names]
        seconds = max(wait_staged(mp) for mp in mps) - started
        statuses = [status(mp) for mp in mps]
    if wait == "0":
        from_store = sum(s["datasets"][0]["staging"]["owned_bytes"] for s in statuses)
    else:
        from_store = sum(s["replication"]["from_store_bytes"] for s in statuses)
    return seconds, from_store


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with workdir(args.workdir, args.keep, "replicas") as work:
        summary = generate_tree(work / "src", args.files, 110 << 10, seed=1)
        populate(work / "src", work / "store", "ds", ["--chunk-size", args.chunk_size,
                                                      "--no-fsync"])
        print(f"{args.files:,} files, {summary.bytes / (1 << 20):,.1f} MiB; {args.nodes} nodes, "
              f"--replicas 2; store {args.store_bandwidth / (1 << 20):.0f} MiB/s per stream")
        got: dict[str, list[tuple[float, int]]] = {"store": [], "primary": []}
        for rnd in range(args.rounds):
            order = (("store", "0"), ("primary", "30"))[:: 1 if rnd % 2 == 0 else -1]
            for name, wait in order:
                got[name].append(stage(work, args, wait, f"{rnd}-{name}"))
            (t_s, b_s), (t_p, b_p) = got["store"][-1], got["primary"][-1]
            print(f"  round {rnd + 1}: from the store {t_s:.2f} s, {b_s / (1 << 20):,.0f} MiB "
                  f"read; from primaries {t_p:.2f} s, {b_p / (1 << 20):,.0f} MiB read; "
                  f"time ratio {t_p / t_s:.3f}, store bytes ratio {b_p / b_s:.3f}", flush=True)
    for label, values in (("staging time, primaries / store",
                           [p[0] / s[0] for p, s in zip(got["primary"], got["store"],
                                                        strict=True)]),
                          ("store bytes, primaries / store",
                           [p[1] / s[1] for p, s in zip(got["primary"], got["store"],
                                                        strict=True)])):
        values.sort()
        print(f"{label}: min {values[0]:.3f} median {values[len(values) // 2]:.3f} "
              f"max {values[-1]:.3f}")
    return 0


if __name__ == "__main__":
    run_main(main)

"""Job 2 on the same nodes: its first epoch from the node cache job 1 left.

One dataset of ~110 KiB files, a pool of --nodes daemons over loopback (each
its own --cache-dir, the node cache that outlives the job), the store paced
to --store-bandwidth per stream. Per round, with fresh cache dirs:

  job 1   mount every node, wait until every node has staged its share, drop
          the page cache, read one shuffled epoch through node 1's mount: the
          baseline, a fully staged warm epoch of job 1; unmount every node
          (the node caches stay)
  job 2   mount every node again on the same cache dirs (new ports: another
          job), drop the page cache, read one shuffled epoch at once, without
          waiting for anything: epoch 1 of job 2, from the adopted copies

Reported per round: files/s of both epochs and their ratio; what job 2 took
from the store (its readers' store bytes on every node, and what its stagers
copied: 0 when every copy was adopted) and the reads its adopted copies
served (`dlfs status`, node_cache). Targets (issue #20): job 2 epoch 1 /
job 1 staged epoch >= 0.9 (median), store bytes of job 2 = 0.

examples (from the repository root, as root):
  .venv/bin/python bench/job2.py --quick
  .venv/bin/python bench/job2.py --files 6000 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time
from pathlib import Path

from _common import (
    Target,
    add_common_args,
    drop_caches,
    formatter,
    mounted,
    populate,
    print_targets,
    run_main,
    size_arg,
    workdir,
)
from _pool import free_ports, status, wait_staged, write_secret

from dlfs.demo.sampledata import generate_tree
from dlfs.demo.workload import shuffled_epoch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p, rounds=5)
    p.add_argument("--files", type=int, default=6000, help="files (default 6000; --quick 1500)")
    p.add_argument("--nodes", type=int, default=2, help="daemons of the pool (default 2)")
    p.add_argument("--workers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--store-bandwidth", type=size_arg, default=50 << 20,
                   help="per-stream store rate (default 50M)")
    p.add_argument("--chunk-size", default="16M", help="populate --chunk-size (default 16M)")
    args = p.parse_args(argv)
    if args.quick:
        args.files = max(200, args.files // 4)
    return args


@contextlib.contextmanager
def job(work: Path, args, tag: str):
    """Every node of one job mounted (fresh ports, the same names and cache dirs)."""
    names = [f"n{i + 1}" for i in range(args.nodes)]
    nodes = ",".join(f"{n}=127.0.0.1:{p}" for n, p in zip(names, free_ports(args.nodes),
                                                           strict=True))
    secret = write_secret(work / f"secret-{tag}")
    with contextlib.ExitStack() as stack:
        mps = []
        for name in names:
            extra = ["--cache-dir", str(work / f"cache-{name}"), "--nodes", nodes, "--node",
                     name, "--secret-file", str(secret),
                     "--store-bandwidth", str(args.store_bandwidth)]
            mps.append(stack.enter_context(mounted(work / "store", work / f"mnt-{name}", extra,
                                                   work / f"dlfsd-{tag}-{name}.log")))
        yield mps


def epoch(mp: Path, paths: list[str], nbytes: int, workers: int, seed: int) -> float:
    r = shuffled_epoch([str(mp / "ds" / p) for p in paths], workers, seed=seed)
    if r.bytes != nbytes:
        raise RuntimeError(f"read {r.bytes} bytes, expected {nbytes}")
    return r.files_per_s


def fresh_statuses(mps: list[Path]) -> list[dict]:
    """Every node's status, written after now."""
    since = time.time()
    out = []
    for mp in mps:
        while (s := status(mp))["updated"] <= since:
            time.sleep(0.1)
        out.append(s)
    return out


def one_round(work: Path, args, paths: list[str], nbytes: int, rnd: int) -> dict:
    for name in range(args.nodes):
        shutil.rmtree(work / f"cache-n{name + 1}", ignore_errors=True)
    with job(work, args, f"{rnd}-1") as mps:
        for mp in mps:
            wait_staged(mp)
        drop_caches()
        job1 = epoch(mps[0], paths, nbytes, args.workers, 2 * rnd)
    with job(work, args, f"{rnd}-2") as mps:
        drop_caches()
        job2 = epoch(mps[0], paths, nbytes, args.workers, 2 * rnd + 1)
        statuses = fresh_statuses(mps)
    entries = [s["datasets"][0] for s in statuses]
    out = {"job1": job1, "job2": job2, "ratio": job2 / job1,
           "store_read": sum(e["sources"]["store"]["bytes"] for e in entries),
           "staged": sum(e["node_cache"]["staged_now_bytes"] for e in entries),
           "adopted": sum(e["node_cache"]["adopted_at_mount"] for e in entries),
           "hits": sum(e["node_cache"]["bytes"] for e in entries),
           "local": entries[0]["sources"]["local"]["bytes"],
           "peer": entries[0]["sources"]["peer"]["bytes"]}
    print(f"  round {rnd + 1}: job 1 staged epoch {job1:,.0f} files/s, job 2 epoch 1 "
          f"{job2:,.0f} files/s, ratio {out['ratio']:.3f}; job 2 store bytes: read "
          f"{out['store_read']:,}, staged {out['staged']:,}; {out['adopted']} chunks adopted, "
          f"{out['hits'] / (1 << 20):,.1f} MiB read from them (node 1: local "
          f"{out['local'] / (1 << 20):,.1f} MiB, peer {out['peer'] / (1 << 20):,.1f} MiB)",
          flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with workdir(args.workdir, args.keep, "job2") as work:
        summary = generate_tree(work / "src", args.files, 110 << 10, seed=1)
        paths = [str(p.relative_to(work / "src")) for p in summary.paths]
        populate(work / "src", work / "store", "ds", ["--chunk-size", args.chunk_size,
                                                      "--no-fsync"])
        print(f"{args.files:,} files, {summary.bytes / (1 << 20):,.1f} MiB; {args.nodes} nodes; "
              f"store {args.store_bandwidth / (1 << 20):.0f} MiB/s per stream; "
              f"{args.workers} reader processes")
        rounds = [one_round(work, args, paths, summary.bytes, r) for r in range(args.rounds)]
    for key, label in (("job1", "job 1 staged epoch files/s"),
                       ("job2", "job 2 epoch 1 files/s"), ("ratio", "ratio job 2 / job 1")):
        values = sorted(r[key] for r in rounds)
        print(f"{label}: min {values[0]:,.3f} median {values[len(values) // 2]:,.3f} "
              f"max {values[-1]:,.3f}")
    ratios = sorted(r["ratio"] for r in rounds)
    store_bytes = max(r["store_read"] + r["staged"] for r in rounds)
    print_targets([Target("job 2 epoch 1 / job 1 staged epoch (median files/s)",
                          ratios[len(ratios) // 2], ">=", 0.9),
                   Target("job 2 store bytes (max over rounds)", store_bytes, "<=", 0)],
                  args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

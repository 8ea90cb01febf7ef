"""The chunk pool with many nodes on one machine: balance, every byte, a lost node.

--nodes daemons (default 16) on loopback, each a `dlfs mount` with its own
cache dir and peer port, --replicas 2, one dataset of --files small files
(dlfs.demo.sampledata.generate_tree) in --chunk-size chunks. Figures:

  mount       each node's `dlfs mount` (min/median/max), and the wall time from
              the first mount to every owned chunk staged on every node
  balance     chunks and bytes each node really staged (its cache dir), against
              an even share (chunks x R / nodes), and against the spread a
              fair random placement has anyway (sigma = sqrt((1-R/N) / share))
  every byte  every file read whole through every node, sha256 against the
              source: files/s per node (min/median/max), where the bytes came
              from. Baseline in the same process: the same read through one
              mount of the same store without a pool (all from the store)
  lost node   one daemon SIGKILLed: every file again through two survivors
              (store requests must stay 0 with R=2), and whether any survivor
              staged anything new meanwhile
  restart     the job started again on the survivors, same cache dirs: the
              copies each one adds must be the lost node's chunks, one new copy
              per lost chunk; copies it had stay (same inode)

All daemons share this machine's cores, so files/s are bounded by the CPU,
not by any network; docs/SCALE.md takes only the counts from here.

examples (from the repository root, as root):
  .venv/bin/python bench/pool_scale.py --quick
  .venv/bin/python bench/pool_scale.py --nodes 16 --files 8000 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
from _common import (
    Target,
    _daemon_pid,
    _daemon_pids,
    add_common_args,
    formatter,
    median,
    mounted,
    populate,
    print_table,
    print_targets,
    run_main,
    size_arg,
    workdir,
)
from _pool import free_ports, write_secret

from dlfs.cluster.placement import owners
from dlfs.demo.sampledata import generate_tree
from dlfs.runtime import status_path
from dlfs.store.store import Store


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p, rounds=1)
    p.add_argument("--nodes", type=int, default=16, help="daemons (default 16)")
    p.add_argument("--replicas", type=int, default=2, help="owners per chunk (default 2)")
    p.add_argument("--files", type=int, default=8000, help="files (default 8000; --quick 1000)")
    p.add_argument("--file-size", type=size_arg, default=8 << 10,
                   help="mean file size (default 8K, lognormally spread)")
    p.add_argument("--chunk-size", default="8K",
                   help="populate --chunk-size (default 8K: ~1 chunk per file, so enough "
                        "chunks per node for a share to be measured)")
    p.add_argument("--workers", default="2", help="each daemon's --workers (default 2)")
    args = p.parse_args(argv)
    if args.quick:
        args.files = max(200, args.files // 8)
    if not 1 <= args.replicas < args.nodes:
        p.error("need 1 <= --replicas < --nodes (a node must be lost with a replica left)")
    return args


def status(mp: Path) -> dict:
    """The daemon's status file (what `dlfs status --json` prints), read directly."""
    return json.loads(status_path(os.path.realpath(mp)).read_text())


def fresh_datasets(mp: Path) -> dict:
    since = time.time()
    while True:
        s = status(mp)
        if s["updated"] > since:
            return {d["name"]: d for d in s["datasets"]}
        time.sleep(0.05)


def all_staged(mps: dict[str, Path]) -> bool:
    for mp in mps.values():
        for d in status(mp)["datasets"]:
            if d["staging"]["staged_chunks"] != d["staging"]["owned_chunks"]:
                return False
    return True


@contextlib.contextmanager
def pool(work: Path, store: Path, names: list[str], args, mount_times: list[float]):
    """Mount every node (one after another); yields {name: mountpoint}."""
    ports = free_ports(len(names))
    nodes = ",".join(f"{n}=127.0.0.1:{p}" for n, p in zip(names, ports, strict=True))
    secret = write_secret(work / "secret")
    with contextlib.ExitStack() as stack:
        mps = {}
        for name in names:
            started = time.monotonic()
            mps[name] = stack.enter_context(mounted(
                store, work / f"mnt-{name}",
                ["--cache-dir", str(work / f"cache-{name}"), "--nodes", nodes, "--node", name,
                 "--replicas", str(args.replicas), "--secret-file", str(secret),
                 "--workers", args.workers, "--peer-timeout", "2"],
                work / f"{name}.log"))
            mount_times.append(time.monotonic() - started)
        yield mps


def staged(work: Path, name: str, uuid: str) -> dict[int, int]:
    """{chunk: inode} of the copies in a node's cache dir."""
    return {int(p.name.split(".")[0]): p.stat().st_ino
            for p in (work / f"cache-{name}" / uuid).glob("*.chunk")}


def read_all(root: Path, digests: dict[str, str]) -> tuple[float, int]:
    """Every file through `root`, sha256-checked: (seconds, files with wrong bytes)."""
    started = time.perf_counter()
    wrong = 0
    for rel, digest in digests.items():
        with open(root / rel, "rb") as f:
            wrong += hashlib.sha256(f.read()).hexdigest() != digest
    return time.perf_counter() - started, wrong


def forget_pages(root: Path, digests: dict[str, str]) -> None:
    """Drop the kernel's cached pages of every file under a mount (the next read goes
    to the daemon), without dropping the whole machine's caches."""
    for rel in digests:
        fd = os.open(root / rel, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def kill(mp: Path) -> None:
    pid = _daemon_pid(mp)
    for p in _daemon_pids(pid) if pid else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    return "/".join(fmt.format(v) for v in (min(values), median(values), max(values)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [f"n{i + 1:02d}" for i in range(args.nodes)]
    victim = names[len(names) // 3]
    with workdir(args.workdir, args.keep, "pool-scale") as work:
        summary = generate_tree(work / "src", args.files, args.file_size, seed=1)
        digests = {str(p.relative_to(work / "src")): hashlib.sha256(p.read_bytes()).hexdigest()
                   for p in summary.paths}
        took = populate(work / "src", work / "store", "ds",
                        ["--chunk-size", args.chunk_size, "--no-fsync"])
        d = Store(work / "store").open("ds")
        uuid, lengths = d.uuid.hex(), np.asarray(d.chunk_lengths, dtype=np.int64)
        print(f"{args.files:,} files, {summary.bytes / (1 << 20):,.1f} MiB in {d.chunk_count:,} "
              f"chunks; populate {took:.1f} s; {args.nodes} nodes, R={args.replicas}")

        baseline: list[float] = []
        wrong_total = 0
        for _ in range(args.rounds):  # one node, no pool: every byte from the store
            with mounted(work / "store", work / "mnt-single", [], work / "single.log") as mp:
                seconds, wrong = read_all(mp / "ds", digests)
                wrong_total += wrong
                baseline.append(args.files / seconds)

        mount_times: list[float] = []
        rates: list[float] = []
        started = time.monotonic()
        with pool(work, work / "store", names, args, mount_times) as mps:
            while not all_staged(mps):
                time.sleep(0.1)
            t_staged = time.monotonic() - started
            before = {n: staged(work, n, uuid) for n in names}
            for _ in range(args.rounds):
                for n in names:
                    seconds, wrong = read_all(mps[n] / "ds", digests)
                    wrong_total += wrong
                    rates.append(args.files / seconds)
            sources = {n: fresh_datasets(mps[n])["ds"]["sources"] for n in names}
            kill(mps[victim])
            survivors = [n for n in names if n != victim]
            lost_rates, lost_wrong = [], 0
            for n in survivors[:2]:
                forget_pages(mps[n] / "ds", digests)  # or the kernel answers, not the daemon
                seconds, wrong = read_all(mps[n] / "ds", digests)
                lost_rates.append(args.files / seconds)
                lost_wrong += wrong
            lost_store = sum(fresh_datasets(mps[n])["ds"]["sources"]["store"]["requests"]
                             for n in survivors[:2])
            unchanged = all(staged(work, n, uuid) == before[n] for n in survivors)

        remount_times: list[float] = []
        started = time.monotonic()
        with pool(work, work / "store", survivors, args, remount_times) as mps:
            while not all_staged(mps):
                time.sleep(0.1)
            t_restaged = time.monotonic() - started
            after = {n: staged(work, n, uuid) for n in survivors}

        # -- balance ------------------------------------------------------------------------
        table = owners(d.uuid, d.chunk_count, names, args.replicas)
        even_chunks = d.chunk_count * args.replicas / args.nodes
        even_bytes = int(lengths.sum()) * args.replicas / args.nodes
        rows, worst = [], 0.0
        for i, n in enumerate(names):
            chunks = sorted(before[n])
            nbytes = int(lengths[chunks].sum()) if chunks else 0
            matches = set(chunks) == set(np.flatnonzero((table == i).any(axis=1)).tolist())
            dev = max(abs(len(chunks) / even_chunks - 1), abs(nbytes / even_bytes - 1))
            worst = max(worst, dev)
            src = sources[n]
            rows.append((n, len(chunks), f"{len(chunks) / even_chunks:.3f}",
                         f"{nbytes / even_bytes:.3f}", "yes" if matches else "NO",
                         f"{src['local']['bytes'] / (1 << 20):.1f}",
                         f"{src['peer']['bytes'] / (1 << 20):.1f}", src["store"]["requests"]))
        sigma = math.sqrt((1 - args.replicas / args.nodes) / even_chunks)
        print_table(("node", "chunks", "/even", "bytes/even", "= placement", "local MiB",
                     "peer MiB", "store reads"), rows,
                    title=f"staged shares (even: {even_chunks:,.1f} chunks; a fair random "
                          f"placement's sigma: {sigma:.1%})")

        # -- movement -------------------------------------------------------------------------
        lost = set(before[victim])
        added: list[int] = []
        kept = True
        for n in survivors:
            kept &= all(after[n].get(c) == ino for c, ino in before[n].items())
            added += sorted(set(after[n]) - set(before[n]))
        moved_ok = sorted(added) == sorted(lost)
        print(f"\nlost node {victim}: owned {len(lost)} chunks; survivors added {len(added)} "
              f"copies, {len(set(added) - lost)} of them not the lost node's; "
              f"{'every' if kept else 'NOT every'} earlier copy kept (same inode)")

        print_table(("measure", "min/median/max", "baseline"), [
            (f"mount of one node (s), {args.nodes} nodes", spread(mount_times, "{:.2f}"), ""),
            ("first mount -> all staged (s)", f"{t_staged:.1f}", ""),
            ("every file through one node, files/s", spread(rates),
             f"{spread(baseline)} (one mount, no pool)"),
            ("after the loss, through a survivor, files/s", spread(lost_rates), ""),
            (f"restart on {len(survivors)}: mount -> all staged (s)", f"{t_restaged:.1f}", ""),
        ], title=f"{args.rounds} round(s)")
        print(f"pool node / one-node files/s (medians): {median(rates) / median(baseline):.2f}")
        print(f"files with wrong bytes: {wrong_total} (all nodes), {lost_wrong} (after the loss);"
              f" store reads after the loss: {lost_store}; survivors' copies unchanged while the"
              f" job ran: {unchanged}")
        print_targets([
            Target("worst node share vs even (chunks or bytes)", worst, "<=", 0.10),
            Target("files with wrong bytes", wrong_total + lost_wrong, "<=", 0),
            Target("store reads after the loss (R>=2)", lost_store, "<=", 0),
            Target("chunks moved that were not the lost node's", len(set(added) - lost), "<=", 0),
            Target("lost chunks given exactly one new copy", float(moved_ok), ">=", 1),
        ], args.quick)
    return 0


if __name__ == "__main__":
    run_main(main)

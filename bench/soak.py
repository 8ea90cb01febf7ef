"""Soak: 16 readers against a 3-node pool while one peer is killed and one partitioned.

Issue 23 item 8 / issue 33 item 4. Three nodes, each daemon in a network
namespace of its own on 10 Gbit/s links (tests/netsim.py; as root). --replicas 2,
so every chunk has two owners; the reading node n1 stages nothing
(--cache-limit 1): all its reads come from n2 and n3, or from the store when
both owners of a chunk are out. Meanwhile:

  every --kill-every s (60)       n3's daemon is killed (SIGKILL) and mounted again
  every --cut-every s (90)        n2 is partitioned (its link down: packets dropped,
                                  no RST) for --cut-for s (20); first cut at 30 s

--readers processes (16) read random files of the mount for --duration s (600)
and compare each with the source's sha256 (then drop its pages, so every read
reaches the daemon; --files x --file-size should exceed the reading node's
64 MiB of shared peer extents, so most reads reach a peer). Every 10 s the open descriptors and
the RSS of every daemon (main and workers, summed per node) are sampled and
printed as a table. At the end: reads, failed reads, wrong bytes, the slowest
read, and how much the descriptors and RSS of the nodes never killed grew
from the first sample after --warmup s (70: one cut and one kill later) to
the last (flat: a few descriptors and MiB at most). The store's chunk files
are counted apart: each process keeps those it read open (a cache bounded by
the dataset's chunk files, which grows whenever both owners of a chunk are
out at once), so only the other descriptors must stay flat.

examples (from the repository root, as root):
  .venv/bin/python bench/soak.py                       # 10 minutes
  .venv/bin/python bench/soak.py --duration 150        # a short one
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from pathlib import Path

from _common import (
    Target,
    _daemon_pid,
    _daemon_pids,
    _unmount,
    add_common_args,
    formatter,
    populate,
    print_table,
    print_targets,
    run_dlfs,
    run_main,
    size_arg,
    workdir,
)
from _pool import status, wait_staged, write_secret

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import netsim

from dlfs.demo.sampledata import generate_tree
from dlfs.store.format import CHUNK_DIR

PORT = 7470
NAMES = ("n1", "n2", "n3")
READER, CUT, KILLED = 0, 1, 2  # node indices


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p, rounds=1)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of reading (600)")
    p.add_argument("--readers", type=int, default=16, help="reader processes (16)")
    p.add_argument("--files", type=int, default=2000, help="files (2000)")
    p.add_argument("--file-size", type=size_arg, default=110 << 10, help="mean size (110K)")
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--cut-every", type=float, default=90.0)
    p.add_argument("--cut-for", type=float, default=20.0)
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=70.0,
                   help="seconds before the descriptor / RSS baseline (70: after the first "
                        "cut and the first kill, which make the reading node's processes "
                        "open connections they had not needed, and after its shared peer "
                        "extents filled up)")
    p.add_argument("--peer-timeout", type=float, default=2.0)
    args = p.parse_args(argv)
    if args.quick:  # one cut and one kill before the baseline, one of each after it
        args.duration = min(args.duration, 150.0)
        args.readers = min(args.readers, 4)
        args.files = min(args.files, 400)
    return args


class Node:
    """One node's mount, started in its namespace; restartable."""

    def __init__(self, net: netsim.Network, index: int, store: Path, work: Path,
                 common: list[str]) -> None:
        self.net, self.index, self.store = net, index, store
        self.name = NAMES[index]
        self.mp = work / f"mnt-{self.name}"
        self.mp.mkdir()
        self.args = ["--cache-dir", str(work / f"cache-{self.name}"), "--node", self.name,
                     "--log-file", str(work / f"{self.name}.log"), *common]
        if index == READER:
            self.args += ["--cache-limit", "1"]
        self.pids: list[int] = []

    def mount(self) -> None:
        with self.net.inside(self.index):
            run_dlfs(["mount", str(self.mp), "--store", str(self.store), *self.args])
        pid = _daemon_pid(self.mp)
        self.pids = _daemon_pids(pid) if pid else []

    def kill(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _unmount(self.mp, self.pids)  # the dead mount: lazily away

    def unmount(self) -> None:
        _unmount(self.mp, self.pids)

    def sample(self) -> tuple[int, int, float, float]:
        """(open descriptors, of them the store's chunk files, RSS MiB, private RSS MiB)
        of the node's daemon processes now. RSS counts the shared mappings (PeerShare's
        extents, the stats) in every process that touched them, so it rises while they
        fill; the private part (RssAnon) is what a leak grows. The store's chunk files
        are counted apart: a process keeps each one it read from open (ExtentSource.
        store_fd), a cache bounded by the dataset's chunk files, which grows whenever
        both owners of a chunk not read from the store before are out at once."""
        pid = _daemon_pid(self.mp)
        fds, store_fds, rss, anon = 0, 0, 0, 0
        store = f"{os.path.realpath(self.store)}/"
        for p in _daemon_pids(pid) if pid else []:
            with contextlib.suppress(OSError):
                names = os.listdir(f"/proc/{p}/fd")
                fds += len(names)
                store_fds += sum(_target(p, n).startswith(store) for n in names)
                with open(f"/proc/{p}/status") as f:
                    kb = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f)
                          if k in ("VmRSS", "RssAnon")}
                rss += kb.get("VmRSS", 0)
                anon += kb.get("RssAnon", 0)
        return fds, store_fds, rss / 1024, anon / 1024


def _target(pid: int, fd: str) -> str:
    """What descriptor `fd` of process `pid` points at ("" if it closed meanwhile)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def _reader(paths: list[str], sums: list[bytes], seed: int, stop, out) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rng = random.Random(seed)
    reads = failed = wrong = 0
    slowest = 0.0
    errors: list[str] = []
    while not stop.is_set():
        i = rng.randrange(len(paths))
        started = time.monotonic()
        try:
            with open(paths[i], "rb") as f:
                data = f.read()
                # Forget the file's pages: the next read of it goes to the daemon again,
                # not to the kernel's cache of the FUSE file.
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as err:
            failed += 1
            if len(errors) < 5:
                errors.append(f"{paths[i]}: {err}")
            continue
        slowest = max(slowest, time.monotonic() - started)
        reads += 1
        if hashlib.sha256(data).digest() != sums[i]:
            wrong += 1
            if len(errors) < 5:
                errors.append(f"{paths[i]}: wrong bytes")
    out.put((reads, failed, wrong, slowest, errors))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = netsim.unavailable()
    if why:
        print(f"cannot soak here: {why}", file=sys.stderr)
        return 2
    with workdir(args.workdir, args.keep, "soak") as work:
        summary = generate_tree(work / "src", args.files, args.file_size, seed=2)
        rel = [str(p.relative_to(work / "src")) for p in summary.paths]
        sums = [hashlib.sha256((work / "src" / r).read_bytes()).digest() for r in rel]
        populate(work / "src", work / "store", "ds", ["--no-fsync"])
        with netsim.Network(3) as net:
            nodes_arg = ",".join(f"{n}={net.address(i)}:{PORT}" for i, n in enumerate(NAMES))
            common = ["--nodes", nodes_arg, "--replicas", "2", "--peer-timeout",
                      str(args.peer_timeout),
                      "--secret-file", str(write_secret(work / "secret"))]
            nodes = [Node(net, i, work / "store", work, common) for i in range(3)]
            try:
                for i, node in enumerate(nodes):
                    net.shape(i, "10gbit")
                    node.mount()
                for node in nodes[1:]:
                    wait_staged(node.mp)
                print(f"{args.files:,} files, {summary.bytes / (1 << 20):,.0f} MiB; "
                      f"{args.readers} readers for {args.duration:.0f} s; {NAMES[KILLED]} "
                      f"killed every {args.kill_every:.0f} s, {NAMES[CUT]} cut for "
                      f"{args.cut_for:.0f} s every {args.cut_every:.0f} s", flush=True)
                result = soak(args, net, nodes, [str(nodes[READER].mp / "ds" / r) for r in rel],
                              sums)
            finally:
                net.heal(CUT)
                for node in nodes:
                    node.unmount()
    return result


def soak(args, net: netsim.Network, nodes: list[Node], paths: list[str],
         sums: list[bytes]) -> int:
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(paths, sums, i, stop, out))
               for i in range(args.readers)]
    for r in readers:
        r.start()
    samples: list[tuple] = []
    events: list[str] = []
    start = time.monotonic()
    next_sample, next_kill, next_cut = 0.0, args.kill_every, 30.0
    cut_until = None
    try:
        while (now := time.monotonic() - start) < args.duration:
            if cut_until is not None and now >= cut_until:
                net.heal(CUT)
                events.append(f"{now:6.1f} s  {NAMES[CUT]} healed")
                cut_until = None
            if now >= next_cut:
                net.cut(CUT)
                events.append(f"{now:6.1f} s  {NAMES[CUT]} cut off")
                cut_until, next_cut = now + args.cut_for, next_cut + args.cut_every
            if now >= next_kill:
                nodes[KILLED].kill()
                events.append(f"{now:6.1f} s  {NAMES[KILLED]} killed")
                nodes[KILLED].mount()
                events.append(f"{time.monotonic() - start:6.1f} s  {NAMES[KILLED]} mounted "
                              "again")
                next_kill += args.kill_every
            if now >= next_sample:
                samples.append((now, *[v for node in nodes for v in node.sample()]))
                next_sample += args.sample_every
            time.sleep(0.2)
    finally:
        stop.set()
        results = []
        for _ in readers:
            with contextlib.suppress(Exception):
                results.append(out.get(timeout=60))
        for r in readers:
            r.join(10)
            if r.is_alive():
                r.kill()
    reads = sum(r[0] for r in results)
    failed = sum(r[1] for r in results)
    wrong = sum(r[2] for r in results)
    slowest = max((r[3] for r in results), default=float("nan"))
    print("\nevents:\n  " + "\n  ".join(events))
    headers = ["t (s)"] + [f"{n} {w}" for n in NAMES
                           for w in ("fds", "store", "RSS", "private")]
    print_table(headers, [(f"{s[0]:.0f}", *s[1:]) for s in samples],
                title="open descriptors (all; of them the store's chunk files), RSS and "
                      "private RSS (MiB) of each node's daemon processes")
    sources = status(nodes[READER].mp)["datasets"][0]["sources"]
    print(f"\nreads {reads:,} ({reads / args.duration:,.0f}/s), failed {failed}, wrong bytes "
          f"{wrong}, slowest read {slowest:.2f} s; reading node's sources: "
          + ", ".join(f"{k} {v['bytes'] / (1 << 20):,.0f} MiB" for k, v in sources.items()
                      if v["bytes"]))
    for r in results:
        for e in r[4]:
            print(f"  {e}")
    base = next((s for s in samples if s[0] >= args.warmup), samples[0] if samples else None)
    targets = [Target("failed reads", failed, "<=", 0), Target("wrong bytes", wrong, "<=", 0),
               Target("readers that reported", len(results), ">=", args.readers)]
    if base is not None and samples:
        last = samples[-1]
        chunks = len(list(nodes[READER].store.glob(f"*/{CHUNK_DIR}/*")))
        for i in (READER, CUT):  # never restarted: their growth is the leak
            a, b = base[1 + 4 * i : 5 + 4 * i], last[1 + 4 * i : 5 + 4 * i]
            other = (a[0] - a[1], b[0] - b[1])
            print(f"{NAMES[i]}: descriptors besides the store's {other[0]} -> {other[1]} "
                  f"({other[1] - other[0]:+d}), store chunk files kept {a[1]} -> {b[1]} "
                  f"(at most {chunks} per process), RSS {a[2]:.0f} -> {b[2]:.0f} MiB "
                  f"({b[2] - a[2]:+.0f}), private {a[3]:.0f} -> {b[3]:.0f} MiB "
                  f"({b[3] - a[3]:+.0f})")
            targets.append(Target(f"{NAMES[i]} descriptor growth (besides the store's)",
                                  other[1] - other[0], "<=", 8))
            targets.append(Target(f"{NAMES[i]} private RSS growth", b[3] - a[3], "<=", 16,
                                  " MiB"))
    print_targets(targets, False)
    return 0 if all(t.ok for t in targets) else 1


if __name__ == "__main__":
    run_main(main)

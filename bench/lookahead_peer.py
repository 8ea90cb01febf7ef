"""The look-ahead fetching an announced epoch from a peer: one request at a time per
connection vs pipelined (--lookahead-pipeline off / on, issue 33 item 1).

Two daemons on loopback, --replicas 1 (a node's look-ahead never asks a co-owner
for a chunk it owns itself), the holder with its share staged (in the page cache:
hot), the reading daemon with --cache-limit 1 (it stages nothing). Per round and
per setting, on a fresh pair of mounts: the samples whose chunks the holder owns
(at most FILL_SAMPLES: what PeerShare keeps ahead of readers that never come) are
registered and announced in a shuffled order on the reading node
(dlfs.order.client, what DLFSSampler does) with a window of all of them
(--lookahead N:...), and nothing reads: the look-ahead fetches them from the
holder into the node's PeerShare as fast as it can (its fetch threads at their
least width, 8: no reader is close behind to widen it). Measured until its
`samples_prefetched` reaches N: samples/s, and the CPU per sample of the holder's
daemon (every process: the peer server's) and of the reading daemon (the
look-ahead's threads). Settings alternate within each round, so the ratios
compare the same machine state; min/median/max over --rounds.

--read N: instead, N reader processes read the announced epoch at once
(dlfs.demo.workload.shuffled_epoch, the order announced) while the look-ahead
fetches ahead of them (its width then follows them): files/s of the epoch, the
holder's CPU per sample, the reading node's (its daemon and the readers).

--local (with --read N): each round also reads the announced epoch on a local mount
(one daemon, its own cache dir, every chunk staged, look-ahead on, the same window),
so that remote/local is printed per round for both settings: what a job that
announces its order (DLFSSampler) gets from a peer against what it gets from its
own NVMe, as pool_read.py --pin measures it for reads in no announced order.

--net: the two daemons in network namespaces of their own, each link shaped to
10 Gbit/s (tests/netsim.py; what pool_read.py --net models).

--pin: the holder on --holder-cpu, the reading daemon on --reader-cpu (as
pool_read.py --pin): each "node" has a CPU of its own.

examples (from the repository root, as root):
  .venv/bin/python bench/lookahead_peer.py --quick
  .venv/bin/python bench/lookahead_peer.py --files 4000 --rounds 5 --pin
  .venv/bin/python bench/lookahead_peer.py --read 8 --local --pin --rounds 3 \
      --mount-args "--lookahead-peers off"   # the readers fetch from the peer themselves
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from pathlib import Path

import numpy as np
from _common import (
    add_common_args,
    children_cpu_seconds,
    daemon_cpu_seconds,
    formatter,
    median,
    populate,
    print_table,
    run_main,
    size_arg,
    workdir,
)
from _pool import status, wait_staged, write_secret
from pool_read import _PIN, in_node, mounted_on, node_addresses, pinned, pinned_and_networked

from dlfs.demo.sampledata import generate_tree
from dlfs.demo.workload import shuffled_epoch
from dlfs.order.client import connect
from dlfs.store.format import MAX_EXTENT_SIZE

SETTINGS = ("off", "on")
LOCAL = "local"  # --local: the reference set-up
# Samples a fill announces at most: the look-ahead fetches no more ahead than PeerShare
# keeps (MAX_SLOTS 1024, less the readers' 16 slots of 4 MiB).
FILL_SAMPLES = 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p, rounds=5)
    p.add_argument("--files", type=int, default=4000, help="files (default 4000; --quick 400)")
    p.add_argument("--file-size", type=size_arg, default=110 << 10,
                   help="bytes per file (default 110K)")
    p.add_argument("--mount-args", default="", help="extra `dlfs mount` arguments for both sides")
    p.add_argument("--read", type=int, default=0, metavar="N",
                   help="N reader processes read the announced epoch (default 0: none, "
                        "the fill alone)")
    p.add_argument("--pin", action="store_true", help="holder and reading node on a CPU each")
    p.add_argument("--local", action="store_true",
                   help="with --read N: also read the announced epoch from a local mount "
                        "and print remote/local per round")
    p.add_argument("--net", action="store_true",
                   help="the two daemons in network namespaces joined by a bridge, each link "
                        "shaped to 10 Gbit/s (tests/netsim.py; as pool_read.py --net)")
    p.add_argument("--holder-cpu", type=int, default=1, help="with --pin (default 1)")
    p.add_argument("--reader-cpu", type=int, default=0, help="with --pin (default 0)")
    args = p.parse_args(argv)
    if args.quick:
        args.files = max(100, args.files // 10)
    if args.local and not args.read:
        p.error("--local compares readers' epochs: give --read N too")
    return args


@contextlib.contextmanager
def pair(work: Path, extra: list[str]):
    """The holder (its share staged) and the reading node (stages nothing), R=1."""
    nodes = node_addresses()
    secret = write_secret(work / "secret")
    common = ["--nodes", nodes, "--replicas", "1", "--secret-file", str(secret), *extra]
    with mounted_on(_PIN["holder"], work / "store", work / "mnt-holder",
                    ["--cache-dir", str(work / "cache-holder"), "--node", "holder", *common],
                    work / "holder.log", node=1) as holder, \
         mounted_on(_PIN["reader"], work / "store", work / "mnt-reader",
                    ["--cache-dir", str(work / "cache-reader"), "--node", "reader",
                     "--cache-limit", "1", *common], work / "reader.log") as reader:
        wait_staged(holder)
        with in_node(0):  # the order socket is abstract: reachable from its namespace only
            yield reader, holder


@contextlib.contextmanager
def local(work: Path, extra: list[str]):
    """--local: one daemon with every chunk staged on its own cache dir (no holder)."""
    with mounted_on(_PIN["reader"], work / "store", work / "mnt-local",
                    ["--cache-dir", str(work / "cache-local"), *extra],
                    work / "local.log") as mount:
        wait_staged(mount)
        with in_node(0):
            yield mount, None


def holders_files(work: Path, paths: list[str]) -> list[str]:
    """The files whose chunks the holder owns (placement; the same on every mount)."""
    with pair(work, ["--lookahead", "1"]) as (reader, _):
        client = connect([str(reader / "ds" / p) for p in paths])
        if client is None:
            raise RuntimeError("the reading mount has no order socket")
        loc = client.locality()
        theirs = loc.chunk_node[loc.sample_chunk] != loc.node
    return [p for p, t in zip(paths, theirs.tolist(), strict=True) if t]


def fill(work: Path, paths: list[str], nbytes: int, setting: str, seed: int,
         extra: list[str], readers: int = 0) -> dict[str, float]:
    """Announce `paths` on a fresh pair and time the look-ahead's fetch of all of
    them from the holder (`readers`: the epoch read by that many processes)."""
    # Without readers nothing is taken, so what is fetched ahead stays pinned: a window of
    # N samples at a slot each (the 16M chunks' extents: MAX_EXTENT_SIZE) makes room for
    # all N (at most FILL_SAMPLES, the share's slots less the readers' own part).
    room = 2 * nbytes if readers else len(paths) * MAX_EXTENT_SIZE
    window = ["--lookahead", f"{len(paths)}:{room}"]
    mounts = local(work, [*extra, *window]) if setting == LOCAL else \
        pair(work, [*extra, *window, "--lookahead-pipeline", setting])
    with mounts as (reader, holder):
        client = connect([str(reader / "ds" / p) for p in paths])
        if client is None:
            raise RuntimeError("the reading mount has no order socket")
        order = list(range(len(paths)))
        random.Random(seed).shuffle(order)
        cpu = (daemon_cpu_seconds(holder) if holder else 0.0, daemon_cpu_seconds(reader))
        started = time.perf_counter()
        client.announce(seed, np.asarray(order))
        if readers:
            before = children_cpu_seconds()
            with pinned(_PIN["reader"]):  # the reader processes are forked in here
                r = shuffled_epoch([str(reader / "ds" / p) for p in paths], readers, seed=seed)
            if r.bytes != nbytes:
                raise RuntimeError(f"read {r.bytes} bytes, expected {nbytes}")
            read_cpu = children_cpu_seconds() - before
            counters = client.status()["counters"]
            done = len(paths)
        deadline = started + 300
        while not readers:
            counters = client.status()["counters"]
            done = counters["samples_prefetched"] + counters["fetch_errors"]
            if done >= len(paths) or time.perf_counter() > deadline:
                break
            time.sleep(0.005)
        seconds = time.perf_counter() - started
        spent = ((daemon_cpu_seconds(holder) if holder else 0.0) - cpu[0],
                 daemon_cpu_seconds(reader) - cpu[1])
        if readers:
            spent = (spent[0], spent[1] + read_cpu)
            hits = json.loads((reader / ".dlfs" / "stats.json").read_text())["mount"]["lookahead"]
        time.sleep(1.2)  # the status file is rewritten every second (STATUS_INTERVAL)
        share = status(reader).get("peer_fetch") or {}
    if done < len(paths):
        raise RuntimeError(f"{setting}: {done} of {len(paths)} samples in 300 s: {counters}")
    n = len(paths)
    result = {"rate": n / seconds, "holder_us": spent[0] * 1e6 / n,
              "reader_us": spent[1] * 1e6 / n, "batches": counters["peer_batches"],
              "peer_fetches": counters["peer_fetches"],
              "from_peers": counters["bytes_prefetched_from_peers"] / nbytes}
    node = "reading node" if readers else "reading daemon"
    took = (f"  hits {hits['hits'] / max(1, hits['hits'] + hits['misses']):.0%}, width "
            f"{counters['fetch_width']}") if readers else ""
    print(f"  {setting:<5} {result['rate']:8,.0f} samples/s  holder {result['holder_us']:5.0f} "
          f"us/sample  {node} {result['reader_us']:5.0f} us/sample{took}  "
          f"({counters['peer_fetches']} peer fetches, {counters['peer_batches']} batches, "
          f"{result['from_peers']:.2f}x the bytes from peers, fetch errors "
          f"{counters['fetch_errors']}; node: {share.get('fetches', 0)} fetches, "
          f"{share.get('shared_reads', 0)} shared reads, {share.get('waits', 0)} waits "
          f"of {share.get('wait_us', 0) / 1e3:,.0f} ms in all, "
          f"{share.get('whole_waits_cut', 0)} cut short, "
          f"{share.get('wait_timeouts', 0)} timed out)", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    return pinned_and_networked(parse_args(argv), _run)


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    with workdir(args.workdir, args.keep, "lookahead-peer") as work:
        summary = generate_tree(work / "src", args.files, args.file_size, seed=1)
        paths = [str(p.relative_to(work / "src")) for p in summary.paths]
        took = populate(work / "src", work / "store", "ds", ["--no-fsync", "--chunk-size", "16M"])
        print(f"{args.files:,} files, {summary.bytes / (1 << 20):,.1f} MiB; populate {took:.1f} s"
              + (f"; holder on CPU {args.holder_cpu}, reading node on CPU {args.reader_cpu}"
                 if args.pin else ""))
        theirs = holders_files(work, paths)
        if not args.read:  # a fill keeps every sample it fetches pinned: no more than fit
            theirs = theirs[:FILL_SAMPLES]
        nbytes = sum((work / "src" / p).stat().st_size for p in theirs)
        print(f"{len(theirs):,} of them ({nbytes / (1 << 20):,.1f} MiB) in the holder's chunks: "
              "announced on the reading node")
        settings = (*SETTINGS, LOCAL) if args.local else SETTINGS
        results: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}")
            for setting in settings if rnd % 2 == 0 else settings[::-1]:
                results[setting].append(fill(work, theirs, nbytes, setting, rnd, extra,
                                             args.read))
        report(results, args.rounds, args.read)
    return 0


def report(results: dict[str, list[dict[str, float]]], rounds: int, readers: int) -> None:
    rows = []
    node = "reading node (daemon + readers)" if readers else "reading daemon"
    for key, label in (("rate", "samples/s"), ("holder_us", "holder CPU us/sample"),
                       ("reader_us", f"{node} CPU us/sample")):
        off = [r[key] for r in results["off"]]
        on = [r[key] for r in results["on"]]
        # a tiny --quick fill may take 0 CPU ticks
        ratios = [b / a if a else float("nan") for a, b in zip(off, on, strict=True)]
        rows.append((label, f"{median(off):,.0f}", f"{median(on):,.0f}", _spread(ratios)))
    if LOCAL in results:
        here = [r["rate"] for r in results[LOCAL]]
        for setting in SETTINGS:
            ratios = [r["rate"] / h for r, h in zip(results[setting], here, strict=True)]
            rows.append((f"remote/local files/s, {setting}", "", "", _spread(ratios)))
        rows.append(("local files/s (median)", "", "", f"{median(here):,.0f}"))
    print_table(("", "off (median)", "on (median)", "on/off per round min/median/max"), rows,
                title=f"look-ahead {'ahead of ' + str(readers) + ' readers' if readers else 'fill'}"
                      f" from one peer, {rounds} rounds")


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}/{median(values):.2f}/{max(values):.2f}"


if __name__ == "__main__":
    run_main(main)

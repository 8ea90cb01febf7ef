"""Random reads of ~110 KiB files (or --file-size) whose chunks live on a peer vs locally.

One store, one dataset (dlfs.demo.sampledata.generate_tree). Two set-ups, mounted
fresh for every measurement and alternating each round:

  local   one daemon with --cache-dir, everything staged on its own cache dir
  remote  two daemons on loopback, --replicas 2 so both own every chunk; the
          reader's daemon gets --cache-limit 1 (stages nothing), so every
          read is served by the peer daemon's staged copy over TCP

Each side reads one shuffled epoch (every file once, --workers processes,
dlfs.demo.workload.shuffled_epoch) after the page cache was dropped ("cold": the
staged chunk files come from disk) and one more on a fresh mount without a
drop ("hot": chunk files in the page cache, FUSE cache empty). The counters
(`dlfs status`) confirm where the bytes came from, and on the remote side
how many bytes the holder sent for the bytes read: large files (--file-size
16M) are read in 1 MiB requests that several of the reading daemon's workers
serve at once, and it must still fetch each extent from the peer once.

Both daemons of the remote set-up share this machine's CPUs, where on a
cluster the holder is another node. So the CPU time per file is printed too:
of the reading node (its daemon and the reader processes) and of the holder's
daemon. With the CPUs saturated, files/s here is bounded by the sum of both.

--pin (issue 23 item 6, issue 33): the holder's daemon runs on one CPU (--holder-cpu,
default 1), the reading daemon and the reader processes on another (--reader-cpu,
default 0), on both sides: a local mount's daemon shares the readers' CPU, as it
would on a node. The holder is then a node of its own, as far as one machine can
make it: remote / local is measured per round (same round, same pinning) and
printed as min/median/max, with the holder's CPU per sample it served
(utime + stime of its processes from /proc/PID/stat, over the samples read).

--peer-procs LIST (issue 33 item 1): the remote side once per value, the holder
mounted with `--peer-procs V` (its peer server in V forked processes; 0: loop
threads in its main process, the way before), every value in every round, so the
set-ups compare within one run: remote/local and the holder's CPU per sample for
each.

--net (issue 33 item 2): the remote side's two daemons run in network namespaces
of their own joined by a bridge (tests/netsim.py), each link shaped to 10 Gbit/s
(and 50 us one way where the kernel has netem); as root.

--floor (with --pin): a reference measured in the same run, after each remote
"hot" epoch while the holder is still up: on the reading CPU, one process reads
every extent of the dataset once (shuffled) through dlfsd.pool.peersync's client
from the holder's peer server and checks it (xxh3), then the same extents with a
pread from the holder's staged copies (in the page cache) and checks them. The
difference is what a peer read costs the reading CPU beyond a local one, with
none of the pool's bookkeeping, FUSE or the readers; added to the local side's
CPU per file it bounds remote/local on a CPU-bound reading node:
bound = local us/file / (local us/file + exchange - pread).

Target (issue #3): remote/local files/s >= 0.7; with --pin (issue 33) >= 0.8.

examples (from the repository root, as root):
  .venv/bin/python bench/pool_read.py --quick
  .venv/bin/python bench/pool_read.py --files 20000 --rounds 3
  .venv/bin/python bench/pool_read.py --files 64 --file-size 16M --rounds 5
  .venv/bin/python bench/pool_read.py --files 2000 --rounds 5 --pin
  .venv/bin/python bench/pool_read.py --files 2000 --rounds 5 --pin --peer-procs 0,2
  .venv/bin/python bench/pool_read.py --files 2000 --rounds 3 --pin --net --workers 8
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _common import (
    Target,
    add_common_args,
    children_cpu_seconds,
    daemon_cpu_seconds,
    drop_caches,
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
from _pool import free_ports, source_counts, status, wait_staged, write_secret

from dlfs.demo.sampledata import generate_tree
from dlfs.demo.workload import shuffled_epoch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--files", type=int, default=10_000, help="files (default 10000; --quick 1000)")
    p.add_argument("--file-size", type=size_arg, default=110 << 10,
                   help="mean file size (default 110K; lognormally spread)")
    p.add_argument("--workers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--mount-args", default="", help="extra `dlfs mount` arguments for both sides")
    p.add_argument("--pin", action="store_true",
                   help="holder daemon on --holder-cpu, reading node and readers on "
                        "--reader-cpu (issue 33's set-up)")
    p.add_argument("--holder-cpu", type=int, default=1, help="with --pin (default 1)")
    p.add_argument("--reader-cpu", type=int, default=0, help="with --pin (default 0)")
    p.add_argument("--net", action="store_true",
                   help="the remote side over network namespaces on 10 Gbit/s links")
    p.add_argument("--floor", action="store_true",
                   help="with --pin: measure the bound remote/local on this machine in the "
                        "same run (the client's exchange against a pread; see above)")
    p.add_argument("--peer-procs", default=None, metavar="LIST",
                   help="measure the remote side with the holder mounted with each "
                        "`--peer-procs` value, e.g. 0,2 (default: the mount's default)")
    args = p.parse_args(argv)
    if args.floor and not args.pin:
        p.error("--floor needs --pin: the bound holds for a reading node on a CPU of its own")
    if args.quick:
        args.files = max(100, args.files // 10)
    return args


@contextlib.contextmanager
def pinned(cpu: int | None):
    """Run the block (and what it starts: `dlfs mount` and so the daemon, the readers)
    on one CPU; nothing changes for None."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


_PIN: dict[str, int | None] = {"holder": None, "reader": None}
_HOLDER: dict[str, object] = {}  # the remote side's holder: host, port (for --floor)
_NET: list = []  # the netsim.Network of --net, once made


@contextlib.contextmanager
def in_node(index: int):
    """The block in node `index`'s namespace with --net; as it is without."""
    if not _NET:
        yield
        return
    with _NET[0].inside(index):
        yield


@contextlib.contextmanager
def mounted_on(cpu: int | None, *args, **kwargs):
    """mounted(), the daemon started (and so its processes and threads) on `cpu`."""
    node = kwargs.pop("node", 0)
    ctx = mounted(*args, **kwargs)
    with pinned(cpu), in_node(node):
        mp = ctx.__enter__()
    try:
        yield mp
    except BaseException as error:
        if not ctx.__exit__(type(error), error, error.__traceback__):
            raise
    else:
        ctx.__exit__(None, None, None)


@contextlib.contextmanager
def local_side(store: Path, work: Path, extra: list[str]):
    cache = work / "cache-local"
    with mounted_on(_PIN["reader"], store, work / "mnt-local", ["--cache-dir", str(cache), *extra],
                 work / "local.log") as mp:
        wait_staged(mp)
        yield mp, None


@contextlib.contextmanager
def remote_side(store: Path, work: Path, extra: list[str], holder_extra: list[str]):
    nodes = node_addresses()
    _HOLDER.update(host=nodes.split("holder=")[1].rsplit(":", 1)[0],
                   port=int(nodes.rsplit(":", 1)[1]))
    secret = write_secret(work / "secret")
    common = ["--nodes", nodes, "--replicas", "2", "--secret-file", str(secret), *extra]
    with mounted_on(_PIN["holder"], store, work / "mnt-holder",
                 ["--cache-dir", str(work / "cache-holder"), "--node", "holder", *common,
                  *holder_extra],
                 work / "holder.log", node=1) as holder, \
         mounted_on(_PIN["reader"], store, work / "mnt-reader",
                 ["--cache-dir", str(work / "cache-reader"), "--node", "reader",
                  "--cache-limit", "1", *common], work / "reader.log") as reader:
        wait_staged(holder)
        yield reader, holder


def measure(side: str, ctx, paths: list[str], nbytes: int, workers: int, seed: int,
            results: dict, floor_work: Path | None = None) -> None:
    """One cold and one hot epoch of `side`; with `floor_work` (--floor) the floor's
    reference after the hot one, while the holder is up."""
    for temp in ("cold", "hot"):
        with ctx() as (mp, holder):
            if temp == "cold":
                drop_caches()
            served = _served(holder, "reads_served") if holder else 0  # (not on the clock)
            before = _cpu(mp, holder)
            with pinned(_PIN["reader"]):  # the reader processes are forked in here
                r = shuffled_epoch([str(mp / "ds" / p) for p in paths], workers, seed=seed)
            cpu = [(b - a) * 1e6 / r.files for a, b in zip(before, _cpu(mp, holder), strict=True)]
            if r.bytes != nbytes:
                raise RuntimeError(f"{side} read {r.bytes} bytes, expected {nbytes}")
            counts = source_counts(mp)
            sent = _served(holder) if holder else 0
            if holder:
                served = _served(holder, "reads_served") - served
            if holder and temp == "hot" and floor_work is not None:
                exchange, local = floor(floor_work, seed)
                results.setdefault(("floor", "exchange"), []).append(exchange)
                results.setdefault(("floor", "pread"), []).append(local)
                print(f"  floor: on the reading CPU a peer read of an extent costs "
                      f"{exchange:.0f} us (client + check), a pread of it {local:.0f} us",
                      flush=True)
        results.setdefault((side, temp), []).append(r.files_per_s)
        results.setdefault((side, temp, "cpu"), []).append(cpu[0] + cpu[1])
        where = ", ".join(f"{k} {v['bytes'] / (1 << 20):.0f} MiB" for k, v in counts.items()
                          if v["bytes"])
        holder_cpu = f", holder daemon {cpu[2]:.0f}" if holder else ""
        if holder:
            holder_cpu += f"; holder sent {sent / nbytes:.2f}x the bytes read"
            results.setdefault((side, temp, "sent"), []).append(sent / nbytes)
            per_read = (cpu[2] * r.files / served) if served else float("nan")
            results.setdefault((side, temp, "holder"), []).append(cpu[2])
            results.setdefault((side, temp, "holder_read"), []).append(per_read)
        print(f"  {side:<6} {temp:<4} {r.files_per_s:9,.0f} files/s {r.mib_per_s:8,.1f} MiB/s"
              f"   (from {where}; CPU us/file: daemon {cpu[0]:.0f}, readers {cpu[1]:.0f}"
              f"{holder_cpu})", flush=True)


def floor(work: Path, seed: int) -> tuple[float, float]:
    """(CPU us per extent read from the holder's peer server by the client, CPU us per
    extent pread from the holder's staged copy), both checked, on the reading CPU (in
    the reading node's namespace with --net): see --floor."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    there, here = ctx.Pipe()
    with pinned(_PIN["reader"]), in_node(0):
        child = ctx.Process(target=_floor_child, args=(work, seed, here))
        child.start()
    here.close()  # the child's end: if it dies, recv() ends (EOFError) instead of waiting
    try:
        result = there.recv()
    except EOFError:
        raise RuntimeError(f"--floor: the measuring process failed (exit code "
                           f"{child.exitcode}); its error is above") from None
    finally:
        child.join()
    return result


def _floor_child(work: Path, seed: int, out) -> None:
    import random

    from dlfs.cluster.nodes import load_secret
    from dlfs.store.format import CHUNK_HEADER_SIZE, checksum, chunk_filename
    from dlfs.store.store import Store
    from dlfsd.pool.peersync import BlockingPeerClient

    ds = Store(work / "store").open("ds")
    arrays = ds.directory.arrays
    extents = list(zip(arrays["ext_chunk"].tolist(), arrays["ext_offset"].tolist(),
                       arrays["ext_length"].tolist(), strict=True))
    random.Random(seed).shuffle(extents)
    client = BlockingPeerClient(load_secret(str(work / "secret")), "reader",
                                str(_HOLDER["host"]), int(_HOLDER["port"]))
    client.read(ds.uuid, *extents[0][:3])  # connected and shaken hands before the clock
    started = time.process_time()
    for chunk, offset, length in extents:
        checksum(client.read(ds.uuid, chunk, offset, length))
    exchange = (time.process_time() - started) / len(extents) * 1e6
    client.close()
    fds = {c: os.open(next((work / "cache-holder").rglob(chunk_filename(c))), os.O_RDONLY)
           for c in {e[0] for e in extents}}
    started = time.process_time()
    for chunk, offset, length in extents:
        checksum(os.pread(fds[chunk], length, CHUNK_HEADER_SIZE + offset))
    local = (time.process_time() - started) / len(extents) * 1e6
    for fd in fds.values():
        os.close(fd)
    out.send((exchange, local))


def _served(holder: Path, counter: str = "bytes_served") -> int:
    """A counter of the holder's peer server (bytes it has sent), from a status written
    after now."""
    since = time.time()
    while True:
        s = status(holder)
        if s["updated"] > since:
            return s["peer_server"][counter]
        time.sleep(0.1)


def _cpu(reader: Path, holder: Path | None) -> tuple[float, float, float]:
    """CPU seconds so far: the reading daemon, the reader processes, the holder daemon."""
    return (daemon_cpu_seconds(reader), children_cpu_seconds(),
            daemon_cpu_seconds(holder) if holder else 0.0)


def main(argv: list[str] | None = None) -> int:
    return pinned_and_networked(parse_args(argv), _run)


def pinned_and_networked(args: argparse.Namespace,
                         run: Callable[[argparse.Namespace, list[str]], int]) -> int:
    """What this bench and lookahead_peer.py do before measuring: --pin's CPUs, --net's
    namespaces (removed after), then run(args, --mount-args split)."""
    if args.pin:
        _PIN.update(holder=args.holder_cpu, reader=args.reader_cpu)
    with contextlib.ExitStack() as stack:
        if args.net:
            why = enter_network(stack)
            if why:
                print(f"--net: {why}", file=sys.stderr)
                return 2
        return run(args, args.mount_args.split())


def enter_network(stack: contextlib.ExitStack) -> str | None:
    """--net: two nodes in network namespaces of their own (tests/netsim.py), each link
    shaped "10gbit", until `stack` closes; mounts then go in with in_node. Returns why
    that cannot be done here, None once done."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import netsim

    if netsim.unavailable():
        return netsim.unavailable()
    net = stack.enter_context(netsim.Network(2))
    for i in range(2):
        net.shape(i, "10gbit")
    _NET.append(net)
    # what netsim makes of the profile here, delay left out where netem is missing
    print(f"remote side over network namespaces, links: {netsim.modeled('10gbit')}")
    return None


def node_addresses() -> str:
    """`--nodes` for the reader (node 0) and the holder (node 1): in their namespaces
    with --net, else on loopback."""
    if _NET:
        net = _NET[0]
        return f"reader={net.address(0)}:7470,holder={net.address(1)}:7470"
    ports = free_ports(2)
    return f"reader=127.0.0.1:{ports[0]},holder=127.0.0.1:{ports[1]}"


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    with workdir(args.workdir, args.keep, "pool-read") as work:
        summary = generate_tree(work / "src", args.files, args.file_size, seed=1)
        paths = [str(p.relative_to(work / "src")) for p in summary.paths]
        took = populate(work / "src", work / "store", "ds", ["--no-fsync"])
        print(f"{args.files:,} files, {summary.bytes / (1 << 20):,.1f} MiB; populate {took:.1f} s;"
              f" {args.workers} reader processes"
              + (f"; holder on CPU {args.holder_cpu}, reading node and readers on CPU "
                 f"{args.reader_cpu}" if args.pin else ""))
        results: dict = {}
        sides = {"local": lambda: local_side(work / "store", work, extra)}
        remotes = remote_sides(args.peer_procs)
        for name, holder_extra in remotes.items():
            sides[name] = (lambda h: lambda: remote_side(work / "store", work, extra, h))(
                holder_extra)
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
            print(f"round {rnd + 1}/{args.rounds}")
            for side in order:
                measure(side, sides[side], paths, summary.bytes, args.workers, rnd, results,
                        work if args.floor and args.pin else None)
        ratios = {name: report_remote(name, results, args.rounds) for name in remotes}
        goal = 0.8 if args.pin else 0.7
        print_targets([Target(f"{temp} {name}/local files/s", ratios[name][temp], ">=", goal)
                       for name in remotes for temp in ("cold", "hot")], args.quick)
    return 0


def remote_sides(peer_procs: str | None) -> dict[str, list[str]]:
    """The remote set-ups to measure: name -> extra `dlfs mount` flags of the holder."""
    if peer_procs is None:
        return {"remote": []}
    return {f"remote p{v}": ["--peer-procs", v] for v in peer_procs.split(",")}


def report_remote(name: str, results: dict, rounds: int) -> dict[str, float]:
    """Print one remote set-up against the local side; its remote/local medians."""
    rows, ratios = [], {}
    for temp in ("cold", "hot"):
        local, remote = median(results[("local", temp)]), median(results[(name, temp)])
        ratios[temp] = remote / local if local else float("nan")
        rows.append((temp, local, remote, ratios[temp]))
    print_table(("chunk files", "local files/s", f"{name} files/s", f"{name}/local"), rows,
                title=f"medians of {rounds} rounds")
    cpu_rows = []
    for temp in ("cold", "hot"):
        local = median(results[("local", temp, "cpu")])
        remote = median(results[(name, temp, "cpu")])
        cpu_rows.append((temp, f"{local:.0f}", f"{remote:.0f}",
                         f"{local / remote:.3f}" if remote else "nan"))
    print_table(("chunk files", "local us/file", f"{name} us/file", "local/remote"),
                cpu_rows, title="CPU of the reading node only (daemon + readers; "
                                "for information, no target)")
    for temp in ("cold", "hot"):  # each round's ratio: same round, same machine state
        per_round = [r / lo for r, lo in zip(results[(name, temp)],
                                            results[("local", temp)], strict=True)]
        print(f"{name} {temp}: remote/local per round {_spread(per_round)} (min/median/max); "
              f"holder CPU us per sample read {_spread(results[(name, temp, 'holder')], 0)}"
              f", per read it served {_spread(results[(name, temp, 'holder_read')], 0)}")
    if ("floor", "exchange") in results:  # --floor: the bound, from this run's medians
        exchange = median(results[("floor", "exchange")])
        local_read = median(results[("floor", "pread")])
        local = median(results[("local", "hot", "cpu")])
        bound = local / (local + exchange - local_read)
        print(f"floor: a peer read costs the reading CPU {exchange:.0f} us (client + check), "
              f"a pread {local_read:.0f} us; with the local side's {local:.0f} us/file (hot) "
              f"remote/local is bounded by {bound:.2f} on a CPU-bound reading node "
              f"({name} hot reached {ratios['hot']:.2f})")
    print(f"{name}: holder bytes sent / bytes read: "
          + ", ".join(f"{temp} {_spread(results[(name, temp, 'sent')])}"
                      for temp in ("cold", "hot")))
    return ratios


def _spread(values: list[float], digits: int = 2) -> str:
    """min/median/max of a few rounds."""
    return f"{min(values):.{digits}f}/{median(values):.{digits}f}/{max(values):.{digits}f}"


if __name__ == "__main__":
    run_main(main)

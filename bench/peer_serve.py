"""A holder's peer server alone: READs of ~110 KiB answered per second, and its CPU per READ.

No FUSE, no reading daemon: the daemon's peer server (dlfsd.pool.peerprocs.PeerServers)
in a process of its own (pinned to --holder-cpus, and so are the processes it
forks) serves a staged chunk file (in the page cache, or dropped before each round
with --cold) to --clients processes (spread over --reader-cpus), each a
BlockingPeerClient reading random --size ranges for --seconds. Printed per
--procs value (forked server processes, as `dlfs mount --peer-procs`; 0: the
loops run in that one process, the way before issue 33) and --threads value (loop
threads per server; issue 33 item 1 asks the curve for 2, 4, 8): READs/s and the
CPU per READ of the server's processes (utime + stime from /proc/PID/stat, the
process and every process it forked), min/median/max over --rounds, and each
set-up's READs/s over the first one's, measured in the same run.

On one machine the holder's CPU includes the kernel's loopback delivery of its
replies (softirq work charged to the sender), as a veth pair in a network
namespace would; a real NIC takes some of that off the CPU.

examples (from the repository root):
  .venv/bin/python bench/peer_serve.py
  .venv/bin/python bench/peer_serve.py --procs 0,1,2 --holder-cpus 1 --reader-cpus 0
  .venv/bin/python bench/peer_serve.py --procs 1,2,4,8 --holder-cpus 0-7 \
      --reader-cpus 8,9,10,11,12,13,14,15 --rounds 5
  .venv/bin/python bench/peer_serve.py --procs 0 --threads 1,2,4,8 --rounds 5
  .venv/bin/python bench/peer_serve.py --procs 0 --batch 1,8 --sendfile --rounds 5

--batch (issue 33 item 1): each client keeps that many READs in flight on its
connection (BlockingPeerClient.read_many, what the look-ahead's fetch threads do
with --lookahead-pipeline on) instead of one: the server's CPU per READ with and
without pipelining, same run.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import time
from pathlib import Path

from _common import (
    add_common_args,
    drop_caches,
    formatter,
    median,
    print_table,
    run_main,
    size_arg,
    workdir,
)

SECRET = b"peer-serve-bench-secret-0123456789"
DATASET = bytes(range(16))
HEADER = 64


class FileProvider:
    """One staged chunk in a real file (the peer server's ChunkProvider)."""

    def __init__(self, path: Path, length: int) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.length = length

    def chunk_limit(self, dataset_id: bytes, chunk: int) -> int | None:
        return self.length if dataset_id == DATASET and chunk == 0 else None

    def staged_file(self, dataset_id: bytes, chunk: int) -> tuple[int, int] | None:
        return self.fd, HEADER

    def will_stage(self, dataset_id: bytes, chunk: int) -> bool:
        return True

    def check_copy(self, dataset_id, chunk, offset, length):
        return False

    def serve_check(self, dataset_id, chunk, offset, length):
        return None

    def served_checked(self, dataset_id, ext, gen) -> None:
        pass

    def staged_copy_failed(self, dataset_id, chunk, fd) -> bool:
        return False


def _serve(path: Path, length: int, procs: int, threads: int, sendfile: bool,
           cpus: set[int], ready, stop) -> None:
    from dlfsd.pool.peerprocs import PeerServers

    os.sched_setaffinity(0, cpus)
    server = PeerServers(SECRET, FileProvider(path, length), "holder", processes=procs,
                         threads=threads, sendfile=sendfile)
    ready.send(server.start("127.0.0.1", 0))
    stop.recv()
    ready.send(server.counters()["reads_served"])
    server.stop()


def _client(port: int, length: int, size: int, seconds: float, seed: int, cpu: int,
            start, out, batch: int = 1) -> None:
    from dlfsd.pool.peersync import BlockingPeerClient

    os.sched_setaffinity(0, {cpu})
    client = BlockingPeerClient(SECRET, f"reader{seed}", "127.0.0.1", port, timeout=10)
    rng = random.Random(seed)
    offsets = [rng.randrange(0, length - size) for _ in range(4096)]
    client.read(DATASET, 0, 0, size)  # connected before the clock
    start.wait()
    reads, deadline, i = 0, time.monotonic() + seconds, 0
    sizes: list[int] = []

    def on_reply(index: int, data) -> None:
        sizes.append(len(data))

    while time.monotonic() < deadline:
        if batch > 1:  # read_many: `batch` READs in flight
            sizes.clear()
            client.read_many([(DATASET, 0, offsets[(i + k) & 4095], size)
                              for k in range(batch)], on_reply)
            if sizes != [size] * batch:
                raise RuntimeError("short read")
        elif len(client.read(DATASET, 0, offsets[i & 4095], size)) != size:
            raise RuntimeError("short read")
        reads += batch
        i += batch
    client.close()
    out.put(reads)


def _cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and of every process under it (the server's supervisor
    and servers), so far."""
    ticks = 0
    for p in _tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{p}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc/*/stat's parent field)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat", "rb") as f:
                parents[int(entry)] = int(f.read().rpartition(b")")[2].split()[1])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += [child for child, parent in parents.items() if parent == p]
    return found


def one_round(path: Path, length: int, procs: int, threads: int, args,
              batch: int = 1) -> tuple[float, float]:
    """(READs/s, server CPU us per READ) of one round."""
    ctx = mp.get_context("fork")
    ready, ready_child = ctx.Pipe()
    stop_child, stop = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(path, length, procs, threads, args.sendfile,
                                              args.holder_cpus, ready_child, stop_child))
    server.start()
    clients = []
    try:
        port = ready.recv()
        start, out = ctx.Event(), ctx.Queue()
        clients = [ctx.Process(target=_client, args=(port, length, args.size, args.seconds,
                                                     i, args.reader_cpus[i % len(args.reader_cpus)],
                                                     start, out, batch))
                   for i in range(args.clients)]
        for c in clients:
            c.start()
        time.sleep(0.5)  # every client connected
        if args.cold:
            drop_caches()
        tree = _tree(server.pid)
        before = _cpu_seconds(server.pid)
        start.set()
        reads = sum(out.get(timeout=args.seconds + 30) for _ in clients)
        cpu = _cpu_seconds(server.pid) - before
        if _tree(server.pid) != tree:
            raise RuntimeError("a server process ended during the round")
        stop.send(None)
        ready.recv()
    finally:
        for c in clients:
            c.join(timeout=10)
            if c.is_alive():
                c.kill()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
    return reads / args.seconds, cpu * 1e6 / max(reads, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    add_common_args(p)
    p.add_argument("--procs", default="0,1,2",
                   help="forked server processes to compare, as `dlfs mount --peer-procs` "
                        "(0: loops in one process, the way before; default 0,1,2)")
    p.add_argument("--threads", default="1", help="loop threads per server to compare "
                   "(default 1)")
    p.add_argument("--clients", type=int, default=8, help="client processes (default 8)")
    p.add_argument("--batch", default="1",
                   help="READs each client keeps in flight, to compare (BlockingPeerClient."
                        "read_many; 1: one at a time, `read`; default 1)")
    p.add_argument("--size", type=size_arg, default=110 << 10, help="bytes per READ (110K)")
    p.add_argument("--seconds", type=float, default=5.0, help="per round (default 5)")
    p.add_argument("--chunk", type=size_arg, default=64 << 20, help="staged file (64M)")
    p.add_argument("--cold", action="store_true", help="drop the page cache each round")
    p.add_argument("--sendfile", action="store_true",
                   help="answer with os.sendfile (zero copy) instead of read + sendmsg")
    p.add_argument("--holder-cpus", type=_cpus, default={1},
                   help="CPUs of the server's processes, e.g. 1 or 0-7 (default 1)")
    p.add_argument("--reader-cpus", type=lambda t: sorted(_cpus(t)), default=[0],
                   help="CPUs the clients are spread over, e.g. 0 or 8-15 (default 0; on "
                        "many cores give as many as clients)")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 1.0
    setups = [(int(n), int(t), int(b)) for n in args.procs.split(",")
              for t in args.threads.split(",") for b in args.batch.split(",")]
    with workdir(args.workdir, args.keep, "peer-serve") as work:
        path = work / "chunk"
        path.write_bytes(b"h" * HEADER + os.urandom(args.chunk))
        results: dict[tuple[int, int, int], list[tuple[float, float]]] = \
            {s: [] for s in setups}
        for rnd in range(args.rounds):
            for n, t, b in setups if rnd % 2 == 0 else setups[::-1]:
                rate, cpu = one_round(path, args.chunk, n, t, args, b)
                results[(n, t, b)].append((rate, cpu))
                print(f"  round {rnd + 1} {_name(n, t, b)}: {rate:8,.0f} READs/s, server CPU "
                      f"{cpu:5.0f} us/READ", flush=True)
        base = median([r for r, _ in results[setups[0]]])
        rows = []
        for setup in setups:
            rates = [r for r, _ in results[setup]]
            cpus = [c for _, c in results[setup]]
            rows.append((_name(*setup), _spread(rates), _spread(cpus),
                         f"{median(rates) / base:.2f}"))
        print_table(("server", "READs/s min/med/max", "server CPU us/READ min/med/max",
                     f"READs/s / {_name(*setups[0])}"), rows,
                    title=f"{args.clients} clients, {args.size} bytes per READ, "
                          f"{'cold' if args.cold else 'hot'}, "
                          f"{'sendfile' if args.sendfile else 'copied'}, server on CPUs "
                          f"{sorted(args.holder_cpus)}, {args.rounds} rounds")
    return 0


def _name(procs: int, threads: int, batch: int = 1) -> str:
    where = f"{procs} procs" if procs else "in-process"
    pipelined = f", {batch} in flight" if batch > 1 else ""
    return f"{where} x {threads} loop{'s' if threads > 1 else ''}{pipelined}"


def _cpus(text: str) -> set[int]:
    """1,3 or 0-7 or a mix."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _spread(values: list[float]) -> str:
    return f"{min(values):,.0f}/{median(values):,.0f}/{max(values):,.0f}"


if __name__ == "__main__":
    run_main(main)

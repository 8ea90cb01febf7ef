"""The model of docs/SCALE.md: epoch time from the chunk pool vs from a parallel file system.

Prints, for a job of --nodes (default 16, 100, 1000), the predicted time of
one epoch read from the pool (every chunk staged, R copies on the nodes'
NVMe) and read from the parallel file system directly (one open per sample),
the staging time, and the counts that break first: peer connections per
daemon, the placement table, the chunks per node (balance).

Every rate is a flag. The defaults are the figures measured on the project's
2-core VM (docs/SCALE.md says which bench printed which) scaled by stated
assumptions (--daemon-cores: the cores a node's daemon may use), and a
typical large parallel file system and GPU node (also flags). Nothing here
runs a daemon; it is arithmetic, so it can be re-run with a site's figures:

  .venv/bin/python bench/scale_model.py
  .venv/bin/python bench/scale_model.py --files 14e6 --file-size 110K --nodes 1000
  .venv/bin/python bench/scale_model.py --pfs-opens 200000 --pfs-bandwidth 2T
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from _common import formatter, print_table, size_arg


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter())
    p.add_argument("--nodes", default="16,100,1000", help="job sizes (default 16,100,1000)")
    p.add_argument("--replicas", type=int, default=2, help="R (default 2)")
    # the dataset
    p.add_argument("--files", type=float, default=14e6, help="samples (default 14e6, ImageNet-21k)")
    p.add_argument("--file-size", type=size_arg, default=110 << 10, help="mean sample (110K)")
    p.add_argument("--chunk-size", type=size_arg, default=64 << 20, help="chunk (default 64M)")
    # measured here (docs/SCALE.md, "Figures measured here")
    p.add_argument("--local-us", type=float, default=125.0,
                   help="daemon CPU us per sample read from its own NVMe copy (measured: "
                        "bench/pool_read.py --pin --net, cold, median; 225 unpinned before)")
    p.add_argument("--remote-us", type=float, default=140.0,
                   help="reading daemon CPU us per sample fetched from a peer (measured: "
                        "same run; 282 unpinned before)")
    p.add_argument("--serve-us", type=float, default=140.0,
                   help="holder daemon's CPU us per sample served (measured: same run; 170 "
                        "before the protocol's fast paths, 275 with one loop before issue 33)")
    p.add_argument("--serve-cores", type=float, default=4.0,
                   help="cores the peer server keeps busy: its `--peer-procs` processes, "
                        "as far as the node gives them cores (auto: half the daemon's, "
                        "4 of the 8 assumed here). Default 4: on a 16-core machine 4 "
                        "processes on 8 cores served 4.44x what one did, 8 served 7.21x "
                        "(bench/peer_serve.py --procs 1,2,4,8 --holder-cpus 0-7 "
                        "--reader-cpus 8-15 --clients 16; 1.4 on this VM's 2 cores)")
    p.add_argument("--placement-ns", type=float, default=55.0,
                   help="owners() ns per (chunk, node) cell at mount (measured)")
    p.add_argument("--manifest-bytes", type=float, default=73.0,
                   help="manifest bytes per file (measured)")
    p.add_argument("--stage-rate", type=size_arg, default=400 << 20,
                   help="one node's stager, store -> NVMe, B/s (assumed; measured here: "
                        "a VM disk)")
    # assumed: the node and the parallel file system
    p.add_argument("--daemon-cores", type=int, default=8,
                   help="cores a node's daemon uses (its --workers; default 8)")
    p.add_argument("--workers", type=int, default=8, help="daemon --workers (default 8)")
    p.add_argument("--max-connections", type=int, default=256,
                   help="the peer server's fixed connection slots before they followed the "
                        "job's size (default 256; now dlfsd.pool.peerserver.connection_slots)")
    p.add_argument("--net", type=size_arg, default=12_500_000_000,
                   help="per-node network B/s (default 12.5G: 100 Gb/s)")
    p.add_argument("--nvme", type=size_arg, default=3_000_000_000,
                   help="per-node NVMe read B/s (default 3G)")
    p.add_argument("--pfs-bandwidth", type=size_arg, default=500_000_000_000,
                   help="parallel file system aggregate B/s (default 500G)")
    p.add_argument("--pfs-opens", type=float, default=50_000,
                   help="parallel file system opens/s, all clients (default 50000)")
    p.add_argument("--pfs-client", type=size_arg, default=5_000_000_000,
                   help="one node's parallel file system client B/s (default 5G)")
    p.add_argument("--demand", type=float, default=24_000,
                   help="samples/s one node's GPUs consume (default 24000: 8 GPUs)")
    return p.parse_args(argv)


@dataclass
class Prediction:
    nodes: int
    chunks_per_node: float
    imbalance: float  # the busiest node's share / an even share (3 sigma)
    pool_cpu: float
    pool_serve: float
    pool_net: float
    pool_nvme: float
    pool: float
    pfs_opens: float
    pfs_bw: float
    pfs: float
    compute: float
    stage: float
    connections: int
    placement_s: float
    table_mib: float
    manifest_tib_at_mount: float


def predict(a: argparse.Namespace, n: int, locality: bool = False) -> Prediction:
    """`locality`: DLFSSampler(mode="locality") orders the epoch so each node reads the
    chunks it holds (docs/ORDER.md); else random order (DistributedSampler's)."""
    files, size = a.files, a.file_size
    data = files * size
    chunks = max(1.0, data / a.chunk_size)
    r = min(a.replicas, n)
    per_node_files = files / n
    remote = 0.0 if locality else 1 - r / n  # a sample's chance of not being on this node
    chunks_per_node = chunks * r / n
    sigma = math.sqrt(max(0.0, 1 - r / n) / chunks_per_node)
    imbalance = 1 + 3 * sigma
    # the pool, every chunk staged: the slowest of the node's resources, the busiest node
    cpu = per_node_files * ((1 - remote) * a.local_us + remote * a.remote_us) / 1e6
    pool_cpu = cpu / a.daemon_cores
    pool_serve = per_node_files * remote * a.serve_us / 1e6 * imbalance / a.serve_cores
    pool_net = per_node_files * remote * size / a.net * imbalance
    # random order: a node's own reads plus what it serves, so the busiest node's share;
    # locality: each node reads an even quota of the epoch from the copies it holds
    pool_nvme = per_node_files * size / a.nvme * (1.0 if locality else imbalance)
    pool = max(pool_cpu, pool_serve, pool_net, pool_nvme)
    # the parallel file system: every sample one open, every byte from its servers
    pfs_opens = files / a.pfs_opens
    pfs_bw = max(data / a.pfs_bandwidth, per_node_files * size / a.pfs_client)
    pfs = max(pfs_opens, pfs_bw)
    compute = per_node_files / a.demand
    stage = max(data * r / a.pfs_bandwidth, chunks * r / a.pfs_opens,
                data * r / n * imbalance / min(a.stage_rate, a.nvme))
    connections = (n - 1) * (a.workers + 1)  # each worker + the look-ahead's probe client
    placement_s = chunks * n * a.placement_ns / 1e9
    table_mib = chunks * (4 * r + 1 + 112) / (1 << 20)  # int32 table, owned, remote tuples
    manifest = files * a.manifest_bytes * n / (1 << 40)
    return Prediction(n, chunks_per_node, imbalance, pool_cpu, pool_serve, pool_net,
                      pool_nvme, pool, pfs_opens, pfs_bw, pfs, compute, stage, connections,
                      placement_s, table_mib, manifest)


def bound(p: Prediction) -> str:
    return ("cpu" if p.pool == p.pool_cpu else "serve" if p.pool == p.pool_serve
            else "net" if p.pool == p.pool_net else "nvme")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    preds = [predict(a, int(n)) for n in a.nodes.split(",")]
    local = {p.nodes: predict(a, p.nodes, locality=True) for p in preds}
    data = a.files * a.file_size
    print(f"dataset: {a.files:,.0f} samples of {a.file_size:,} B = {data / 1e12:.2f} TB in "
          f"{data / a.chunk_size:,.0f} chunks of {a.chunk_size >> 20} MiB; R={a.replicas}")
    rows = []
    for p in preds:
        q = local[p.nodes]
        rows.append((f"{p.nodes:,} nodes", f"{p.pool:.2f}", bound(p), f"{q.pool:.2f}", bound(q),
                     f"{p.pfs:.2f}", "opens" if p.pfs == p.pfs_opens else "bandwidth",
                     f"{p.pfs / p.pool:.1f}x", f"{p.compute:.2f}"))
    print_table(("job", "pool random s", "bound by", "pool locality s", "bound by",
                 "PFS s", "bound by", "PFS/pool random", "GPU compute s"), rows,
                title="one epoch (the slowest node)")
    rows = []
    for p in preds:
        rows.append((f"{p.nodes:,} nodes", f"{p.pool_cpu:.2f}", f"{p.pool_serve:.2f}",
                     f"{p.pool_net:.3f}", f"{p.pool_nvme:.2f}", f"{p.chunks_per_node:,.1f}",
                     f"{p.imbalance:.2f}"))
    print_table(("job", "cpu s", "serve s", "net s", "nvme s", "chunks/node",
                 "busiest/even"), rows, title="the pool's terms, random order")
    rows = []
    for p in preds:
        rows.append((f"{p.nodes:,} nodes", f"{p.stage:.1f}", f"{p.connections:,}",
                     "FULL" if p.connections > a.max_connections else "ok",
                     f"{max(a.max_connections, p.connections + 64):,}",
                     f"{p.placement_s:.1f}", f"{p.table_mib:.1f}",
                     f"{p.manifest_tib_at_mount:.3f}"))
    print_table(("job", "staging s", "peer conns in", f"{a.max_connections} slots (before)",
                 "slots now",
                 "placement s", "table MiB", "manifests read TiB"), rows,
                title="what grows with the job")
    return 0


if __name__ == "__main__":
    main()

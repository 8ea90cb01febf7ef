"""`mpirun -n N dlfs mount --mpi ...`: one daemon per rank, the ranks agree on the pool.

Outside a Slurm prolog, MPI is how a user starts one daemon on each node: the
ranks exchange their host names, rank 0 makes the job secret and broadcasts
it, each rank writes it 0600 and mounts with the same node list (node i
listens on --port-base + i). Each rank then reports how its mount went; if any
failed, the others unmount again and rank 0 prints one line, so the launch
either brings up the whole pool or leaves nothing running. That holds when a
rank never gets to report too (Ctrl-C on mpirun, a killed rank): each daemon
keeps its mount only once its rank, after hearing from every rank, commits it
(dlfs.cli.mountctl.mount_uncommitted). The daemons run in their own sessions and
outlive mpirun; `mpirun -n N dlfs umount --mpi MOUNTPOINT` stops them (same
names, same %n expansion).

mpi4py is imported only here (optional dependency: pip install dlfs[mpi]).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from dlfs.cluster.slurm import expand_pattern, write_secret_file
from dlfs.errors import DlfsError, ReportedElsewhere, UsageError
from dlfs.runtime import mountpoint_key, mountpoint_path, runtime_dir


@dataclass(frozen=True)
class Rank:
    comm: object
    rank: int
    size: int
    names: tuple[str, ...]  # node name of every rank
    hosts: tuple[str, ...]  # short host name of every rank

    @property
    def name(self) -> str:
        return self.names[self.rank]


def node_names(hosts: list[str]) -> list[str]:
    """A node name per rank: the host name, or HOST-RANK where ranks share a host
    (several daemons on one machine, each needs its own name, paths and port)."""
    counts = Counter(hosts)
    return [host if counts[host] == 1 else f"{host}-{rank}" for rank, host in enumerate(hosts)]


def join_world() -> Rank:
    try:
        from mpi4py import MPI
    except ImportError:
        raise DlfsError("--mpi needs mpi4py: pip install 'dlfs[mpi]' (and an MPI library "
                        "such as openmpi)") from None
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname().split(".")[0])
    return Rank(comm, comm.Get_rank(), comm.Get_size(), tuple(node_names(hosts)), tuple(hosts))


def expand_node(world: Rank, pattern: str) -> str:
    """%n -> this rank's node name; %j -> SLURM_JOB_ID (or 'mpi' outside Slurm)."""
    return expand_pattern(pattern, os.environ.get("SLURM_JOB_ID", "mpi"), world.name)


def share_secret(world: Rank) -> str:
    """Rank 0's fresh random secret, on every rank (a collective: call it on all ranks)."""
    return world.comm.bcast(secrets.token_hex(32) if world.rank == 0 else None, root=0)


def check_mpi_flags(args: argparse.Namespace) -> None:
    """Flags every rank sees alike, so every rank fails alike (before any collective)."""
    if args.nodes or args.nodes_file or args.node or args.slurm:
        raise UsageError("--mpi takes the nodes from the MPI ranks; drop --nodes, "
                         "--nodes-file, --node and --slurm")
    if args.foreground:
        raise UsageError("--mpi mounts in the background (the ranks check that every "
                         "mount came up); drop --foreground")
    if not args.cache_dir:
        raise UsageError("--mpi builds a chunk pool: give --cache-dir (use %n for a "
                         "per-node directory)")


def default_secret_file(world: Rank, mountpoint: str) -> str:
    return launch_secret_file(world.name, mountpoint_path(mountpoint))


def launch_secret_file(node: str, mountpoint: str) -> str:
    """Where `dlfs mount --mpi` writes node `node`'s copy of the job secret by default
    (`dlfs umount --mpi` removes it; so does a daemon whose launch failed), for canonical
    `mountpoint`. One per mountpoint: two launches on one node (two jobs) must not
    share, or remove, one another's."""
    return str(runtime_dir() / f"mpi-{node}-{mountpoint_key(mountpoint)}.secret")


def apply_mpi(args: argparse.Namespace, world: Rank, secret: str) -> None:
    """Fill this rank's cluster flags: node list, our name, expanded paths, and the
    shared secret written 0600 to --secret-file (default: in our runtime dir)."""
    for flag in ("mountpoint", "log_file", "cache_dir", "secret_file", "summary_file"):
        value = getattr(args, flag)
        if value:
            setattr(args, flag, expand_node(world, value))
    args.secret_file = args.secret_file or default_secret_file(world, args.mountpoint)
    write_secret_file(args.secret_file, secret, None, None)
    hosts = [expand_pattern(args.node_host, "", host) for host in world.hosts]
    args.nodes = [",".join(f"{name}={host}:{args.port_base + i}"
                           for i, (name, host) in enumerate(zip(world.names, hosts,
                                                                strict=True)))]
    args.node = world.name


def all_or_nothing(world: Rank, step: Callable[[], object], undo: Callable[[], object]) -> int:
    """Run `step` on every rank; if any rank failed, `undo` where it succeeded and
    report the first failure once (rank 0). No collective may come after a
    failure point inside `step`, so every error becomes a message here."""
    error = None
    try:
        step()
    except DlfsError as err:
        error = str(err)
    except OSError as err:
        error = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
    errors = world.comm.allgather(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return 0
    if error is None:
        undo()
    rank, message = failed[0]
    more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
    line = f"rank {rank} ({world.names[rank]}){more}: {message}"
    if world.rank == 0:
        raise DlfsError(line)
    raise ReportedElsewhere(line)

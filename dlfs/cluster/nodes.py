"""The cluster view of one mount: which daemons form the job's chunk pool.

A job's daemons are named nodes with a TCP address each (`NAME=HOST:PORT`),
given on the command line, in a file, or (under Slurm) derived from the job.
Every daemon receives the same list, so every daemon computes the same
placement; this daemon is the entry named by `--node` (default: this host's
short name). Peers authenticate with a per-job secret read from a file that
only its owner may read.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from dlfs.errors import DlfsError, NotFoundError, UsageError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MIN_SECRET_BYTES = 16


@dataclass(frozen=True)
class Node:
    """One daemon of the job's pool."""

    name: str
    host: str
    port: int
    #: Where the node listens instead if `port` is taken on its host, in order of
    #: preference (`NAME=HOST:PORT/ALT/...`; `dlfs mount --slurm` lists the job's next
    #: ports of the span, dlfs.cluster.slurm.peer_nodes): the node takes the first one
    #: free, its peers try them in the same order until one proves the job's secret.
    alt_ports: tuple[int, ...] = ()

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.port, *self.alt_ports)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.name}={host}:{'/'.join(map(str, self.ports))}"


def parse_node(text: str) -> Node:
    """`NAME=HOST:PORT[/ALT...]` (HOST may be `[v6addr]`) -> Node; UsageError says what
    is wrong."""
    name, sep, address = text.strip().partition("=")
    host, colon, ports_text = address.rpartition(":")
    if not sep or not colon or not host:
        raise UsageError(f"bad node {text!r}: expected NAME=HOST:PORT, e.g. n1=10.0.0.1:7100")
    if not _NAME_RE.match(name):
        raise UsageError(f"bad node name {name!r} in {text!r}: use letters, digits, '.', '_', '-'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    ports = []
    for port_text in ports_text.split("/"):
        try:
            port = int(port_text)
        except ValueError:
            port = 0
        if not 1 <= port <= 65535:
            raise UsageError(f"bad port {port_text!r} in {text!r}: expected 1-65535")
        ports.append(port)
    return Node(name, host, ports[0], tuple(ports[1:]))


def parse_nodes(items: list[str] | tuple[str, ...]) -> list[Node]:
    """Parse a node list (each item may itself be comma-separated); names must be unique."""
    nodes = [parse_node(part) for item in items for part in item.split(",") if part.strip()]
    seen: set[str] = set()
    addresses: dict[tuple[str, int], str] = {}
    for node in nodes:
        if node.name in seen:
            raise UsageError(f"node {node.name!r} is listed twice")
        seen.add(node.name)
        other = addresses.setdefault((node.host, node.port), node.name)
        if other != node.name:  # one of them could never listen: it would ask itself
            raise UsageError(f"nodes {other!r} and {node.name!r} have the same address "
                             f"{node.host}:{node.port}; give each its own port")
    return nodes


def read_nodes_file(path: str) -> list[str]:
    """Lines `NAME=HOST:PORT` of a nodes file; blank lines and `#` comments are skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise NotFoundError(f"nodes file {path} does not exist") from None
    except OSError as err:
        raise DlfsError(f"cannot read nodes file {path}: {err.strerror}") from None
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [line for line in lines if line]


def default_node_name() -> str:
    return socket.gethostname().split(".")[0]


def select_self(nodes: list[Node], name: str | None) -> int:
    """Index of this daemon's entry: the one named `name`, else this host's short name."""
    wanted = name or default_node_name()
    for i, node in enumerate(nodes):
        if node.name == wanted:
            return i
    listed = ", ".join(n.name for n in nodes)
    how = "--node" if name else "this host's name (pass --node NAME)"
    raise UsageError(f"{how} {wanted!r} is not in the node list ({listed})")


def load_secret(path: str) -> bytes:
    """The job secret; refuses a file that group or others could read (or too short)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise NotFoundError(f"secret file {path} does not exist") from None
    except OSError as err:
        raise DlfsError(f"cannot open secret file {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"secret file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise UsageError(f"secret file {path} is readable by group or others "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`")
        secret = os.read(fd, 65536).strip()
    finally:
        os.close(fd)
    if len(secret) < MIN_SECRET_BYTES:
        raise UsageError(f"secret file {path} holds {len(secret)} bytes; use at least "
                         f"{MIN_SECRET_BYTES} random bytes, e.g. `openssl rand -hex 32 > {path}`")
    return secret


@dataclass(frozen=True)
class ClusterView:
    """The resolved pool: all nodes, which one we are, replicas, the secret."""

    nodes: tuple[Node, ...]
    self_index: int
    replicas: int
    secret: bytes

    @property
    def me(self) -> Node:
        return self.nodes[self.self_index]

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]


def node_addresses(nodes: tuple[Node, ...] | list[Node]) -> frozenset[str]:
    """Every IP address the nodes' host names resolve to: where peer connections of the
    job come from (the peer server gives others only a few slots). A name that does not
    resolve adds nothing; its node's connections are then treated as strangers' until
    they prove the secret."""
    found: set[str] = set()
    for host in {n.host for n in nodes}:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError:
            continue
        found.update(str(info[4][0]).split("%")[0] for info in infos)
    return frozenset(found)


def resolve_cluster(node_items: tuple[str, ...], node: str | None, replicas: int,
                    secret_file: str | None) -> ClusterView:
    """Validate the cluster flags of a mount into a ClusterView (no nodes: a pool of one)."""
    nodes = parse_nodes(node_items) if node_items else [Node(node or default_node_name(),
                                                             "127.0.0.1", 0)]
    index = select_self(nodes, node)
    if replicas < 1:
        raise UsageError(f"--replicas must be at least 1, got {replicas}")
    if replicas > len(nodes):
        raise UsageError(f"--replicas {replicas} exceeds the {len(nodes)} nodes listed")
    if len(nodes) > 1 and not secret_file:
        raise UsageError("a pool of several nodes needs --secret-file (a per-job secret, "
                         "mode 0600, the same on every node)")
    secret = load_secret(secret_file) if secret_file else b""
    return ClusterView(tuple(nodes), index, replicas, secret)

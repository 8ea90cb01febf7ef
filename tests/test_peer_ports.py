"""A peer port taken on a node leads to the job's next port, and the nodes agree.

The prolog's nodes cannot ask each other which port is free, so the fallback is a
rule each computes alike (dlfs.cluster.slurm.peer_nodes: the job's slot, then the
next slots of the span): a daemon listens on the first of its ports it can bind
(dlfsd.assemble.take_free_port) and a peer's client tries them in the same order,
keeping the first that proves the job's secret. Here the rule (pure), its round
trip through the `--nodes` syntax, and real clients against real peer servers:
a refused port and another job's daemon on the first port both lead to the right
server, and the port that worked is the one tried first next time. The whole story
under Slurm is in tests/test_slurm.py.
"""

from __future__ import annotations

import socket

import pytest
from peerfakes import DATASET, SECRET, FileProvider

from dlfs.cluster.nodes import parse_node, parse_nodes
from dlfs.cluster.slurm import PORT_TRIES, SHARED_HOST_STRIDE, SlurmJob, peer_nodes
from dlfsd.pool.peer import PeerUnreachable
from dlfsd.pool.peerserver import PeerLoopServer
from dlfsd.pool.peersync import BlockingPeerClient

CHUNKS = [bytes(range(256)) * 400]
OTHER_JOB = b"another-jobs-secret-0123456789"


def test_every_node_computes_the_same_fallback_ports_in_the_span():
    nodes = ("node1", "node2", "node3")
    for job_id in ("5", "99", "100"):
        views = [peer_nodes(SlurmJob(job_id, nodes, me), 7000, "%n", port_span=100)
                 for me in nodes]
        assert views[0] == views[1] == views[2]  # the same list on every node
        ports = views[0][0].port, *views[0][0].alt_ports
        slot = int(job_id) % 100
        assert ports == tuple(7000 + (slot + k) % 100 for k in range(PORT_TRIES))  # wraps
    shared = peer_nodes(SlurmJob("7", nodes, "node1"), 7000, "127.0.0.1", port_span=6400)
    assert [(p.port, p.alt_ports) for p in shared] == [
        (7000 + 7 * SHARED_HOST_STRIDE + i,
         tuple(7000 + (7 + k) * SHARED_HOST_STRIDE + i for k in range(1, PORT_TRIES)))
        for i in range(3)]
    one_slot = peer_nodes(SlurmJob("7", nodes, "node1"), 7000, "%n", port_span=1)
    assert all(p.alt_ports == () for p in one_slot)  # one DLFS job per node: no fallback
    # What `mount --slurm` passes the daemon (--nodes) comes back whole.
    specs = [p.spec() for p in views[0]]
    assert specs[0] == "node1=node1:7000/7001/7002/7003"
    parsed = parse_nodes(specs)
    assert [(n.port, n.alt_ports) for n in parsed] == [(p.port, p.alt_ports) for p in views[0]]
    assert str(parse_node("a=[::1]:7000/7064")) == "a=[::1]:7000/7064"


@pytest.fixture
def servers(tmp_path):
    """start(secret) -> the port of a real peer server of the job with that secret."""
    running = []

    def start(secret: bytes) -> int:
        provider = FileProvider(tmp_path / str(len(running)), CHUNKS, [len(CHUNKS[0])])
        server = PeerLoopServer(secret, provider, f"server-{len(running)}")
        running.append((server, provider))
        return server.start("127.0.0.1", 0)

    yield start
    for server, provider in running:
        server.stop()
        provider.close()


def taken_port() -> socket.socket:
    """A port bound by something that is no peer server (bound, not listening:
    connecting is refused, binding it fails)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def test_a_client_finds_the_peer_on_its_next_port(servers, tmp_path):
    ours = servers(SECRET)
    with taken_port() as taken:
        client = BlockingPeerClient(SECRET, "client", "127.0.0.1", taken.getsockname()[1],
                                    timeout=2.0, alt_ports=(ours,))
        assert bytes(client.read(DATASET, 0, 10, 100)) == CHUNKS[0][10:110]
        assert client.port == ours
        client.close()
        assert bytes(client.read(DATASET, 0, 0, 5)) == CHUNKS[0][:5]  # straight there
        client.close()
        alone = BlockingPeerClient(SECRET, "client", "127.0.0.1", taken.getsockname()[1],
                                   timeout=2.0)
        with pytest.raises(PeerUnreachable):  # no fallback given: as before
            alone.read(DATASET, 0, 0, 5)


def test_another_jobs_daemon_on_the_first_port_is_passed_over(servers, tmp_path):
    other, ours = servers(OTHER_JOB), servers(SECRET)
    client = BlockingPeerClient(SECRET, "client", "127.0.0.1", other, timeout=2.0,
                                alt_ports=(ours,))
    assert bytes(client.read(DATASET, 0, 0, 100)) == CHUNKS[0][:100]
    assert client.port == ours
    client.close()

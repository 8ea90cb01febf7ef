"""Strangers cannot starve the pool: the peer server's admission of connections.

The rules (dlfsd.pool.admission) driven directly, then a real PeerLoopServer on
loopback flooded with idle connections from an address outside the node list
(127.0.0.2; every 127/8 address is this machine) while a real peer reads from
127.0.0.1.
"""

from __future__ import annotations

import logging
import socket

import pytest
from peerfakes import DATASET, SECRET, FileProvider

from dlfs.cluster.nodes import Node, node_addresses
from dlfsd.pool.admission import (
    FULL,
    SOURCE_FULL,
    STRANGERS_FULL,
    Admission,
    RefusalLog,
    plain_ip,
)
from dlfsd.pool.peerserver import PeerLoopServer
from dlfsd.pool.peersync import BlockingPeerClient

NODE = "10.0.0.1"
STRANGER = "192.0.2.7"


def test_a_stranger_gets_a_few_pending_slots_and_the_nodes_keep_theirs():
    a = Admission(frozenset({NODE}), max_connections=16, stranger_slots=6, per_source=4)
    assert [a.admit(STRANGER, 0) for _ in range(5)] == [None] * 4 + [SOURCE_FULL]
    assert [a.admit(f"192.0.2.{i}", 0) for i in (8, 9, 10)] == [None, None, STRANGERS_FULL]
    # the node's own connections are not held back by the strangers' pending ones
    assert [a.admit(NODE, 6) for _ in range(4)] == [None] * 4
    assert a.admit(NODE, 16) == FULL


def test_authenticating_or_closing_frees_a_pending_slot():
    a = Admission(frozenset({NODE}), max_connections=16, stranger_slots=3, per_source=2)
    assert a.admit(STRANGER, 0) is None and a.admit(STRANGER, 1) is None
    assert a.admit(STRANGER, 2) == SOURCE_FULL
    a.authenticated(STRANGER)  # it knew the secret: a peer, wherever it comes from
    assert a.admit(STRANGER, 2) is None
    a.closed_pending(STRANGER)
    a.closed_pending(STRANGER)
    a.closed_pending(STRANGER)  # one more than pending: ignored, never negative
    assert [a.admit(STRANGER, 0) for _ in range(3)] == [None, None, SOURCE_FULL]


def test_one_node_address_may_not_hold_every_slot_unauthenticated():
    a = Admission(frozenset({NODE}), max_connections=16, per_source=2)
    assert [a.admit(NODE, 0) for _ in range(5)] == [None] * 4 + [SOURCE_FULL]


def test_servers_of_several_processes_split_the_nodes_pending_limits():
    """Each of 4 server processes (dlfsd.pool.peerprocs) admits on its own: together
    they hold a stranger to the node's 32 pending slots and 4 per address, and one
    node address to a quarter of the slots, not 4 times that."""
    def servers() -> list[Admission]:
        return [Admission(frozenset({NODE}), max_connections=256, share=4) for _ in range(4)]

    each = servers()
    assert sum(a.admit(f"192.0.2.{i}", 0) is None for a in each for i in range(20)) == 32
    each = servers()
    assert sum(a.admit(STRANGER, 0) is None for a in each for _ in range(4)) == 4
    each = servers()
    assert sum(a.admit(NODE, 0) is None for a in each for _ in range(100)) == 64
    assert each[0].admit("10.0.0.9", 256) == FULL  # the node's open connections, all of them


def test_without_a_node_list_every_address_counts_as_a_node():
    a = Admission(None, max_connections=8, stranger_slots=1, per_source=1)
    assert [a.admit(STRANGER, 0) for _ in range(3)] == [None, None, SOURCE_FULL]


def test_dual_stack_addresses_compare_as_ipv4():
    assert plain_ip("::ffff:10.0.0.1") == NODE and plain_ip("fe80::1") == "fe80::1"
    a = Admission(frozenset({"::ffff:10.0.0.1"}), max_connections=8)
    assert not a.is_stranger(NODE)


def test_node_addresses_resolve_the_hosts_of_the_list():
    nodes = [Node("a", "127.0.0.1", 1), Node("b", "localhost", 2),
             Node("c", "no-such-host.invalid", 3)]
    found = node_addresses(nodes)
    assert "127.0.0.1" in found
    assert all("invalid" not in addr for addr in found)


def test_refusals_log_once_then_a_sum_per_interval(caplog):
    now = [0.0]
    refusals = RefusalLog(interval=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="dlfsd.pool.peer"):
        for i in range(300):
            refusals.refused(f"192.0.2.{i % 3}", STRANGERS_FULL)
            refusals.flush()
        now[0] = 61.0
        refusals.flush()
        refusals.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "299 more connections from 3 addresses" in lines[1]


@pytest.fixture
def guarded_server(tmp_path):
    provider = FileProvider(tmp_path, [b"x" * 100_000])
    server = PeerLoopServer(SECRET, provider, "holder", handshake_timeout=5.0,
                            trusted=frozenset({"127.0.0.1"}))
    server.port = server.start("0.0.0.0", 0)
    yield server
    server.stop()
    provider.close()


def _connect_from(source: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def test_a_flood_from_outside_the_node_list_does_not_keep_a_peer_out(guarded_server, caplog):
    """300 idle connections from a stranger (more than the 256 slots), none of which
    ever says hello: the job's peer is still served by the holder, and the refusals
    make a line or two of log, not 300."""
    flood = []
    with caplog.at_level(logging.WARNING, logger="dlfsd.pool.peer"):
        try:
            for _ in range(300):
                flood.append(_connect_from("127.0.0.2", guarded_server.port))
            client = BlockingPeerClient(SECRET, "peer", "127.0.0.1", guarded_server.port,
                                        timeout=5)
            try:
                assert client.read(DATASET, 0, 0, 1000) == b"x" * 1000
            finally:
                client.close()
        finally:
            for sock in flood:
                sock.close()
    counters = guarded_server.counters()
    assert counters["reads_served"] == 1
    assert counters["connections_rejected"] >= 300 - guarded_server.admission.per_source
    refusal_lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refusal_lines) <= 2, [r.getMessage() for r in refusal_lines]

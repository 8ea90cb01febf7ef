"""PeerServers (dlfsd.pool.peerprocs): the peer server in forked processes on one port.

Real sockets on loopback and real forks; the provider is tests/peerfakes.FileProvider.
What a daemon adds (the chunk pool as provider, `dlfs status`, unmount) is
tests/test_pool_procs.py.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import random
import signal
import socket
import time
from pathlib import Path

import pytest
import trio
from conftest import pid_alive
from peerfakes import DATASET, SECRET, FileProvider

from dlfs.obs.healthview import peer_server_problems
from dlfs.procs import all_pids, parent_pid
from dlfsd.pool.peerprocs import PeerServers, peer_processes
from dlfsd.pool.peersync import BlockingPeerClient

CHUNK = random.Random(3).randbytes(2 << 20)


@pytest.fixture
def provider(tmp_path):
    p = FileProvider(tmp_path / "chunks", [CHUNK])
    yield p
    p.close()


@pytest.fixture
def peer_log(tmp_path):
    """The peer server's log lines, from every process (forked ones inherit the handler)."""
    path = tmp_path / "peer.log"
    handler = logging.FileHandler(path)
    logger = logging.getLogger("dlfsd.pool.peer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield path
    logger.removeHandler(handler)
    logger.setLevel(level)
    handler.close()


@pytest.fixture
def servers(provider):
    made: list[PeerServers] = []

    def start(processes: int, **kwargs) -> tuple[PeerServers, int]:
        s = PeerServers(SECRET, provider, "holder", processes=processes, **kwargs)
        made.append(s)
        return s, s.start("127.0.0.1", 0)

    yield start
    for s in made:
        s.stop()
    assert children() == [], "a server process outlived stop()"


def children(of: int | None = None) -> list[int]:
    """The child processes of `of` (this process) not reaped yet (any state)."""
    parent = os.getpid() if of is None else of
    return [pid for pid in all_pids() if parent_pid(pid) == parent]


def client(port: int) -> BlockingPeerClient:
    return BlockingPeerClient(SECRET, "reader", "127.0.0.1", port, timeout=5, own_buffer=True)


def read_exact(c: BlockingPeerClient, rng: random.Random) -> None:
    offset = rng.randrange(len(CHUNK) - 200_000)
    length = rng.randrange(1, 200_000)
    assert bytes(c.read(DATASET, 0, offset, length)) == CHUNK[offset:offset + length]


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_auto_is_half_the_cores_at_least_one_at_most_eight_and_a_count_wins():
    assert peer_processes(3) == 3 and peer_processes(0) == 0
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert peer_processes(None) == 1
    finally:
        os.sched_setaffinity(0, before)
    assert peer_processes(None) == max(1, min(8, len(before) // 2))


def test_reads_through_several_processes_are_exact_and_counted_once(servers):
    server, port = servers(3)
    clients = [client(port) for _ in range(9)]
    try:
        def work(i: int) -> None:
            rng = random.Random(i)
            for _ in range(40):
                read_exact(clients[i], rng)

        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            list(pool.map(work, range(9)))
        total = server.counters()
        assert total["processes"] == 3 and total["restarts"] == 0
        assert total["reads_served"] == 9 * 40
        assert total["connections_open"] == total["connections_accepted"] == 9
        each = server.counters_by_process()
        assert len(each) == 3
        for name in ("reads_served", "bytes_served", "connections_open"):
            assert sum(c[name] for c in each) == total[name], name
    finally:
        for c in clients:
            c.close()
    wait_for(lambda: server.counters()["connections_open"] == 0)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_killed_server_is_logged_once_restarted_and_serving_goes_on(servers, peer_log,
                                                                       processes):
    """With one server too: the port stays open in the supervisor, which starts
    another at once, and the client's read reconnects to it."""
    server, port = servers(processes)
    c = client(port)
    rng = random.Random(1)
    try:
        for _ in range(5):
            read_exact(c, rng)
        served = server.counters()["reads_served"]
        owner = [p for p, counts in zip(server_pids(server), server.counters_by_process(),
                                        strict=True) if counts["connections_open"]]
        assert len(owner) == 1
        os.kill(owner[0], signal.SIGKILL)  # the process holding our connection
        wait_for(lambda: server.counters()["restarts"] == 1
                 and server.counters()["processes"] == processes)
        for _ in range(5):  # the lost connection is made again, to a live server
            read_exact(c, rng)
        counts = server.counters()
        assert counts["reads_served"] == served + 5  # the dead one's reads still count
        assert counts["connections_open"] == 1
    finally:
        c.close()
    assert owner[0] not in server_pids(server)
    died = [line for line in peer_log.read_text().splitlines() if "died" in line]
    assert len(died) == 1 and f"peer server process {owner[0]} died (killed by SIGKILL)" \
        in died[0], died


def server_pids(server: PeerServers) -> list[int]:
    """The servers' pids, by slot, as their processes name themselves."""
    pids = [0] * server.processes
    for pid in grandchildren():
        with open(f"/proc/{pid}/comm") as f:
            name = f.read().strip()
        if name.startswith("dlfsd-peer "):
            pids[int(name.split()[1])] = pid
    return pids


def grandchildren() -> list[int]:
    return [pid for child in children() for pid in children(child)]


def test_a_dead_supervisor_is_started_again_and_its_servers_with_it(servers, peer_log):
    server, port = servers(2)
    c = client(port)
    rng = random.Random(2)

    async def main() -> None:
        with trio.fail_after(30):
            await restart_and_read()

    async def restart_and_read() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.watch)
            await trio.to_thread.run_sync(read_exact, c, rng)
            (supervisor,) = children()
            old = server_pids(server)
            os.kill(supervisor, signal.SIGKILL)
            while not (server.counters()["restarts"] == 2
                       and server.counters()["processes"] == 2):
                await trio.sleep(0.02)
            assert not set(server_pids(server)) & set(old)
            assert not any(pid_alive(pid) for pid in old)  # they ended with it
            for _ in range(3):
                await trio.to_thread.run_sync(read_exact, c, rng)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        c.close()
    assert "supervisor process" in peer_log.read_text()


def _own_servers(provider_dir: Path, report) -> None:
    """A stand-in for a daemon's main process: start servers, say who they are, wait."""
    provider = FileProvider(provider_dir, [CHUNK])
    server = PeerServers(SECRET, provider, "holder", processes=2)
    port = server.start("127.0.0.1", 0)
    time.sleep(0.3)
    report.send((port, [os.getpid(), *grandchildren(), *children()]))
    time.sleep(60)


def test_a_killed_owner_takes_the_supervisor_and_the_servers_with_it(tmp_path):
    """SIGKILL of the daemon's main process, no cleanup: its supervisor gets the
    parent-death signal and stops the servers, which get it too should the supervisor
    be gone first; the port is closed."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    owner = ctx.Process(target=_own_servers, args=(tmp_path / "chunks", theirs))
    owner.start()
    try:
        port, pids = ours.recv()
        assert len(pids) == 4  # owner, supervisor, two servers
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(10)
        wait_for(lambda: not any(pid_alive(pid) for pid in pids), timeout=15)
        with pytest.raises(ConnectionRefusedError), socket.socket() as sock:
            sock.connect(("127.0.0.1", port))
    finally:
        if owner.is_alive():
            owner.kill()


def test_a_server_whose_loop_ended_on_an_error_is_replaced(servers, peer_log, monkeypatch):
    """A loop that ends on an unexpected error (logged) leaves a process that accepts
    nothing: it exits, and its supervisor says so and starts another."""
    from dlfsd.pool.peerserver import PeerLoopServer

    def broken(self, now: float) -> None:
        raise RuntimeError("a bug in the sweep")

    monkeypatch.setattr(PeerLoopServer, "_sweep", broken)  # in the processes forked next
    server, _ = servers(1)
    wait_for(lambda: server.counters()["restarts"] >= 1)
    text = peer_log.read_text()
    assert "stopped by an unexpected error" in text and "died (exit code 1)" in text, text
    # It keeps dying young: its slot waits out a back-off, and `dlfs status` says so.
    wait_for(lambda: server.counters()["processes"] == 0 and server.counters()["restarts"] >= 1)
    counts = server.counters()
    assert counts["configured"] == 1
    lines = peer_server_problems(counts)
    assert len(lines) == 1 and "0 of 1 processes running" in lines[0], lines


def test_zero_processes_serves_from_loops_of_this_process(servers):
    server, port = servers(0, threads=2)
    c = client(port)
    try:
        read_exact(c, random.Random(4))
        assert children() == []
        assert server.counters()["reads_served"] == 1
    finally:
        c.close()

"""A holder serving its peers from several processes (`dlfs mount --peer-procs`), with
real daemons on loopback.

Two nodes, --replicas 2 so both own every chunk: the holder stages everything, the
reader stages nothing (--cache-limit 1), so every byte the reader reads comes over
TCP from the holder's server processes (what bench/pool_read.py measures).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import daemon_pids_for, pid_alive
from test_pool import (
    free_ports,
    fresh_status,
    pool_source_tree,
    source_files,
    wait_staged,
    write_secret,
)

pytestmark = pytest.mark.usefixtures("daemon_guard")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return pool_source_tree(tmp_path_factory.mktemp("procs") / "src")


@pytest.fixture(scope="module")
def store(source, tmp_path_factory) -> Path:
    from conftest import populate_store

    return populate_store(source, tmp_path_factory.mktemp("procs-store") / "store", "ds",
                          "256K", "--no-fsync")


def holder_and_reader(mounted, store: Path, base: Path, procs: str):
    ports = free_ports(2)
    nodes = f"reader=127.0.0.1:{ports[0]},holder=127.0.0.1:{ports[1]}"
    common = ["--nodes", nodes, "--replicas", "2", "--peer-timeout", "2",
              "--secret-file", str(write_secret(base / "secret"))]
    holder = mounted(store, "--cache-dir", str(base / "cache-holder"), "--node", "holder",
                     "--peer-procs", procs, "--workers", "1", *common)
    reader = mounted(store, "--cache-dir", str(base / "cache-reader"), "--node", "reader",
                     "--cache-limit", "1", "--workers", "4", *common)
    return holder, reader


def read_files(mount, source: Path, files: list[Path]) -> list[str]:
    """The files whose bytes through `mount` differ from the source."""
    return [str(rel) for rel in files
            if (Path(mount.path) / "ds" / rel).read_bytes() != (source / rel).read_bytes()]


def server_processes(mount) -> list[int]:
    """The holder daemon's peer server processes (named `dlfsd-peer N`)."""
    found = []
    for pid in daemon_pids_for(os.path.realpath(mount.path)):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().startswith("dlfsd-peer "):
                    found.append(pid)
        except OSError:
            continue
    return found


def sockets_of(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return count


def test_bytes_through_several_server_processes_are_exact_a_killed_one_is_replaced(
        mounted, store, source, tmp_path, dlfs_cli):
    """Every byte the reader reads comes from the holder's three server processes, exact;
    the one holding the most of the reader's connections is SIGKILLed between two reads:
    the holder logs it once and starts another, the reader's next reads go to the live
    ones (its connection is made again, no read fails, none goes to the store), and
    the holder's counters, summed over its processes (the dead one's included), match
    what the reader fetched."""
    holder, reader = holder_and_reader(mounted, store, tmp_path, "3")
    wait_staged(dlfs_cli, holder)
    files = source_files(source)
    random.Random(5).shuffle(files)
    half = len(files) // 2
    assert read_files(reader, source, files[:half]) == []
    servers = server_processes(holder)
    assert len(servers) == 3
    victim = max(servers, key=sockets_of)
    os.kill(victim, signal.SIGKILL)
    assert read_files(reader, source, files[half:]) == []
    deadline = time.monotonic() + 10
    while (served := fresh_status(dlfs_cli, holder)["peer_server"])["restarts"] < 1:
        assert time.monotonic() < deadline, served
    assert served["processes"] == 3 and served["restarts"] == 1, served
    after = server_processes(holder)
    assert len(after) == 3 and victim not in after
    got = fresh_status(dlfs_cli, reader)
    sources = got["datasets"][0]["sources"]
    assert sources["store"]["requests"] == 0, sources
    assert sources["local"]["bytes"] == 0, sources
    total = sum((source / rel).stat().st_size for rel in files)
    assert sources["peer"]["bytes"] == total, sources
    fetched = got["peer_fetch"]
    assert served["reads_served"] == fetched["fetches"], (served, fetched)
    assert served["bytes_served"] == fetched["fetched_bytes"], (served, fetched)
    assert served["read_errors"] == 0 and served["auth_failures"] == 0, served
    died = [line for line in holder.log_text().splitlines() if " died " in line]
    assert len(died) == 1 and f"peer server process {victim} died (killed by SIGKILL)" \
        in died[0], died
    text = dlfs_cli("status", holder.path).stdout
    assert "3 server processes" in text and "1 restarted" in text, text


def test_a_holder_serving_from_its_main_process_still_serves(mounted, store, source, tmp_path,
                                                              dlfs_cli):
    """--peer-procs 0: the loops in the main process, the way before (kept to compare)."""
    holder, reader = holder_and_reader(mounted, store, tmp_path, "0")
    wait_staged(dlfs_cli, holder)
    assert server_processes(holder) == []
    files = source_files(source)[::7]
    assert read_files(reader, source, files) == []
    sources = fresh_status(dlfs_cli, reader)["datasets"][0]["sources"]
    assert sources["store"]["requests"] == 0 and sources["peer"]["bytes"] > 0, sources


def test_no_server_process_outlives_the_holder(mounted, store, source, tmp_path, dlfs_cli,
                                               sysproc):
    """Unmounted: every process of the daemon is gone when `dlfs umount` returns. Killed
    (SIGKILL of the main process, no cleanup): the servers and their supervisor end
    with it, and the peer port closes (peers then see a refused connection, not a
    server that never answers)."""
    holder, reader = holder_and_reader(mounted, store, tmp_path, "2")
    wait_staged(dlfs_cli, holder)
    assert read_files(reader, source, source_files(source)[:20]) == []
    pids = daemon_pids_for(os.path.realpath(holder.path))
    assert len(server_processes(holder)) == 2
    assert dlfs_cli("umount", holder.path).returncode == 0
    assert [pid for pid in pids if pid_alive(pid)] == []

    again = mounted(store, "--cache-dir", str(tmp_path / "cache-again"), "--peer-procs", "2",
                    "--nodes", f"a=127.0.0.1:{free_ports(1)[0]},b=127.0.0.1:1", "--node", "a",
                    "--secret-file", str(tmp_path / "secret"))
    port = int(json.loads(dlfs_cli("status", again.path, "--json").stdout)["nodes"][0]
               .rsplit(":", 1)[1])
    pids = daemon_pids_for(os.path.realpath(again.path))
    assert len(server_processes(again)) == 2
    os.kill(again.pid, signal.SIGKILL)
    assert [pid for pid in pids if not sysproc.wait_dead(pid, 10)] == [], \
        "daemon processes outlived the main one"
    with pytest.raises(ConnectionRefusedError), socket.socket() as sock:
        sock.connect(("127.0.0.1", port))
    assert dlfs_cli("umount", again.path).returncode == 0

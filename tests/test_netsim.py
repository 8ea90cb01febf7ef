"""The chunk pool over a modeled network (tests/netsim.py): each node's daemon in a
network namespace of its own, joined by veth pairs to a bridge, shaped with tc.

The pool's main tests (tests/test_pool.py) run over loopback; two of them run
here again over 10 Gbit/s links, and the tests of what loopback cannot show:
a partition (packets dropped, no RST) costs a reader one --peer-timeout, and a
slow link (10 Mbit/s; 1% loss where the kernel has netem) is avoided while
another owner is faster. Expected bytes come from the source tree.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import netsim
import pytest
from conftest import daemon_pids_for, kill_and_reap
from test_pool import (
    expected_shares,
    fresh_sources,
    pool_source_tree,
    read_and_compare,
    source_files,
    staged_chunks,
    wait_staged,
    write_secret,
)

from dlfs.sampledata import generate_tree

pytestmark = [pytest.mark.usefixtures("daemon_guard"),
              pytest.mark.skipif(netsim.unavailable() is not None,
                                 reason=str(netsim.unavailable()))]

PORT = 7470  # every node has its own namespace, so its own ports
TIMEOUT = 2.0  # --peer-timeout


@pytest.fixture(scope="module")
def net_source(tmp_path_factory) -> Path:
    return pool_source_tree(tmp_path_factory.mktemp("net") / "src")


@pytest.fixture(scope="module")
def net_store(net_source, tmp_path_factory) -> Path:
    from conftest import populate_store

    return populate_store(net_source, tmp_path_factory.mktemp("net-store") / "store", "ds",
                          "256K", "--no-fsync")


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    """~110 KiB samples, as issue 33 measures (a slow link shows in each read)."""
    root = tmp_path_factory.mktemp("big") / "src"
    generate_tree(root / "train", 160, 110 * 1024, files_per_dir=80, seed=3)
    return root


@pytest.fixture(scope="module")
def big_store(big_source, tmp_path_factory) -> Path:
    from conftest import populate_store

    return populate_store(big_source, tmp_path_factory.mktemp("big-store") / "store", "ds",
                          "1M", "--no-fsync")


@pytest.fixture
def network(mounted, request):
    """A Network of `request.param` nodes (made after `mounted`, so removed before the
    mounts are: the daemons keep their namespaces until they exit)."""
    with netsim.Network(request.param) as net:
        yield net


class NetCluster:
    """One mount per node, each daemon started in its node's namespace."""

    def __init__(self, mounted, net: netsim.Network, store: Path, base: Path,
                 replicas: int = 1, profile: str | None = "10gbit",
                 extra_by_node: dict[int, tuple[str, ...]] | None = None) -> None:
        n = len(net.names)
        self.net = net
        self.names = [f"n{i + 1}" for i in range(n)]
        self.nodes = ",".join(f"{name}={net.address(i)}:{PORT}"
                              for i, name in enumerate(self.names))
        self.caches = [base / f"cache-{name}" for name in self.names]
        secret = write_secret(base / "secret")
        self.mounts = []
        for i, name in enumerate(self.names):
            if profile:
                net.shape(i, profile)
            with net.inside(i):
                self.mounts.append(mounted(
                    store, "--cache-dir", str(self.caches[i]), "--nodes", self.nodes,
                    "--node", name, "--replicas", str(replicas), "--secret-file", str(secret),
                    "--workers", "2", "--peer-timeout", str(TIMEOUT),
                    *(extra_by_node or {}).get(i, ())))


def timed_reads(mount, source: Path, files: list[Path]) -> tuple[list[float], list[str]]:
    """Seconds per file read, and what went wrong (an error or wrong bytes)."""
    took, errors = [], []
    for rel in files:
        started = time.monotonic()
        try:
            got = (Path(mount.path) / "ds" / rel).read_bytes()
        except OSError as err:
            errors.append(f"{rel}: {err}")
            continue
        finally:
            took.append(time.monotonic() - started)
        if got != (source / rel).read_bytes():
            errors.append(f"{rel}: wrong bytes")
    return took, errors


# -- the main pool tests, over 10 Gbit/s links ----------------------------------------------
@pytest.mark.parametrize("network", [3], indirect=True)
def test_three_nodes_read_identical_over_the_network(mounted, network, net_store,
                                                     net_source, tmp_path, dlfs_cli):
    cluster = NetCluster(mounted, network, net_store, tmp_path)
    shares = expected_shares(net_store, cluster.names, 1)
    for i, mount in enumerate(cluster.mounts):
        wait_staged(dlfs_cli, mount)
        assert staged_chunks(cluster.caches[i]) == shares[i]
    files = source_files(net_source)
    for mount in cluster.mounts:
        read_and_compare(mount, net_source, files)
    for i, mount in enumerate(cluster.mounts):
        sources = fresh_sources(dlfs_cli, mount)
        assert sources["store"]["requests"] == 0, f"{cluster.names[i]} went to the store"
        assert sources["peer"]["bytes"] > 0


@pytest.mark.parametrize("network", [3], indirect=True)
def test_a_killed_peer_costs_no_failed_read_over_the_network(mounted, network, net_store,
                                                             net_source, tmp_path, dlfs_cli):
    cluster = NetCluster(mounted, network, net_store, tmp_path, replicas=2)
    for mount in cluster.mounts:
        wait_staged(dlfs_cli, mount)
    reader, victim = cluster.mounts[0], cluster.mounts[2]
    files = source_files(net_source)
    random.Random(5).shuffle(files)
    cut = len(files) // 10
    _, errors = timed_reads(reader, net_source, files[:cut])
    for pid in daemon_pids_for(os.path.realpath(victim.path)):
        os.kill(pid, signal.SIGKILL)
    for pid in victim.pids:
        kill_and_reap(pid)
    _, more = timed_reads(reader, net_source, files[cut:])
    assert errors + more == []
    assert fresh_sources(dlfs_cli, reader)["store"]["requests"] == 0  # the replica served

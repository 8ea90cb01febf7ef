"""The look-ahead through real mounts: a sampler's announced order is read ahead.

A client registers the mount's files over the order socket (dlfs.order.client,
the same one DLFSSampler uses) and announces an epoch; the daemon's counters
(`.dlfs/stats.json`) and the order socket's status say what it fetched and
what the readers took. Every byte read is compared with the source.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import run_dlfs

from dlfs.order.client import OrderClientError, connect

pytestmark = pytest.mark.usefixtures("daemon_guard")

FILES = 300
FILE_SIZE = 50_000


@pytest.fixture(scope="module")
def la_source(tmp_path_factory):
    src = tmp_path_factory.mktemp("la-src")
    rng = np.random.default_rng(7)
    for i in range(FILES):
        (src / f"f{i:04d}").write_bytes(rng.bytes(FILE_SIZE))
    return src


@pytest.fixture(scope="module")
def la_store(la_source, store_with):
    return store_with(la_source, "ds", "1M")


def mount_paths(mount) -> list[str]:
    return [os.path.join(mount.path, "ds", f"f{i:04d}") for i in range(FILES)]


def stats(mount) -> dict:
    """The mount's counters now: read by a new process each time (a process's own
    `.dlfs/` snapshot is reused for a moment, see dlfsd.obs.control)."""
    out = subprocess.run(["cat", str(mount.path / ".dlfs" / "stats.json")],
                         capture_output=True, check=True, timeout=30).stdout
    return json.loads(out)


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_an_announced_epoch_is_fetched_ahead_and_taken_by_the_readers(
        mounted, la_store, la_source):
    mount = mounted(la_store, "--store-bandwidth", "20M")
    paths = mount_paths(mount)
    client = connect(paths)
    assert client is not None and client.unknown == 0
    locality = client.locality()
    assert (locality.node, locality.node_count) == (0, 1)
    assert locality.sample_chunk.min() >= 0
    order = np.random.default_rng(1).permutation(FILES)
    client.announce(0, order)
    window = 256  # the default --lookahead samples
    assert wait_for(lambda: client.status()["counters"]["samples_prefetched"] >= window), \
        client.status()
    for i in order:
        data = open(paths[i], "rb").read()  # noqa: SIM115
        want = (la_source / f"f{i:04d}").read_bytes()
        assert hashlib.sha256(data).digest() == hashlib.sha256(want).digest()
    final = stats(mount)
    taken = final["mount"]["lookahead"]
    assert taken["hits"] >= window, (final["lookahead"], taken)  # all fetched before the reads
    assert taken["hits"] + taken["misses"] == FILES
    assert final["lookahead"]["bytes_prefetched"] >= window * FILE_SIZE
    assert final["lookahead"]["fetch_errors"] == 0
    assert wait_for(lambda: client.status()["streams"] == [])  # finished: forgotten


def test_bad_announcements_get_one_line_and_the_mount_serves_on(mounted, la_store, tmp_path):
    mount = mounted(la_store)
    paths = mount_paths(mount)
    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"x")
    assert connect([str(outside)]) is None  # not under a DLFS mount: a plain sampler
    with pytest.raises(OrderClientError, match="not a DLFS mountpoint"):
        connect(paths, mount=str(tmp_path))
    client = connect([*paths[:3], os.path.join(mount.path, "ds", "missing"),
                      os.path.join(mount.path, "ds")])
    assert client.unknown == 2  # a missing file and a directory are no samples
    assert list(client.locality().sample_chunk[3:]) == [-1, -1]
    with pytest.raises(OrderClientError, match="out of range"):
        client.announce(0, np.array([0, 9]))
    client.handle = 999
    with pytest.raises(OrderClientError, match="unknown registration 999"):
        client.announce(0, np.array([0]))
    assert open(paths[0], "rb").read()  # noqa: SIM115


def test_ranks_registering_the_same_paths_share_one_resolution(mounted, la_store):
    """Every rank and DataLoader worker of a node registers the same list: it is
    resolved once, each still gets a handle of its own, and a different list is
    resolved anew."""
    mount = mounted(la_store)
    paths = mount_paths(mount)
    first, second = connect(paths), connect(paths)
    other = connect(paths[::-1])
    assert len({first.handle, second.handle, other.handle}) == 3
    for client in (first, second):
        np.testing.assert_array_equal(client.locality().sample_chunk,
                                      first.locality().sample_chunk)
    np.testing.assert_array_equal(other.locality().sample_chunk,
                                  first.locality().sample_chunk[::-1])
    second.announce(0, np.arange(FILES))  # its handle is live on its own
    lines = [line for line in mount.log.read_text().splitlines() if "registration" in line]
    assert [("resolved before" in line) for line in lines] == [False, True, False], lines


READER = """
import os, sys, time
import numpy as np
from dlfs.order.client import connect
paths = sys.argv[1:]
client = connect(paths)
client.announce(0, np.arange(len(paths)))
for p in paths[:5]:
    open(p, "rb").read()
print("announced", flush=True)
time.sleep(600)
"""


def test_a_killed_reader_leaves_its_stream_to_be_dropped(mounted, la_store):
    mount = mounted(la_store, "--lookahead-stale", "1")
    paths = mount_paths(mount)
    reader = subprocess.Popen([sys.executable, "-c", READER, *paths], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert reader.stdout.readline().strip() == "announced"
    finally:
        reader.kill()
        reader.wait()
    client = connect(paths[:1])
    assert wait_for(lambda: client.status()["streams"] == [], 30)
    assert stats(mount)["lookahead"]["streams_dropped_stale"] == 1


def test_lookahead_zero_leaves_no_order_socket(mounted, la_store):
    mount = mounted(la_store, "--lookahead", "0")
    with pytest.raises(OrderClientError, match="no DLFS daemon answers"):
        connect(mount_paths(mount))
    assert "lookahead" not in stats(mount)


def test_dlfs_stats_shows_the_lookahead(mounted, la_store):
    mount = mounted(la_store)
    paths = mount_paths(mount)
    connect(paths).announce(0, np.arange(FILES))
    for path in paths:
        open(path, "rb").read()  # noqa: SIM115
    out = subprocess.run([sys.executable, "-m", "dlfs.cli.main", "stats", str(mount.path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "look-ahead: 1 epochs announced" in out.stdout
    assert f"missed {FILES - stats(mount)['mount']['lookahead']['hits']}" in out.stdout


def test_in_a_pool_extents_no_peer_has_staged_are_read_ahead_from_the_store(
        mounted, tmp_path):
    """Two nodes, R=1, staging slowed down: samples whose chunks the other node owns but
    has not staged yet are probed there (MISS), then fetched ahead from the store; every
    byte read through the announcing node is the source's."""
    from test_pool import Cluster, pool_source_tree

    source = pool_source_tree(tmp_path / "src")
    from conftest import populate_store

    store = populate_store(source, tmp_path / "store", "ds", "256K", "--no-fsync")
    pool = Cluster(mounted, store, tmp_path, 2, extra=("--store-bandwidth", "2M",
                                                    "--stage-jobs", "1"))
    mount = pool.mounts[1]  # a node with worker processes
    files = sorted(p for p in source.rglob("*") if p.is_file())
    paths = [str(mount.path / "ds" / p.relative_to(source)) for p in files]
    client = connect(paths)
    assert client.locality().node_count == 2
    client.announce(0, np.arange(len(paths)))
    assert wait_for(lambda: client.status()["counters"]["peer_fetches"] > 0, 60)
    for path, want in zip(paths, files, strict=True):
        data = open(path, "rb").read()  # noqa: SIM115
        assert hashlib.sha256(data).digest() == hashlib.sha256(want.read_bytes()).digest()
    counters = stats(mount)
    assert counters["lookahead"]["bytes_prefetched"] > 0
    assert counters["mount"]["lookahead"]["hits"] > 0


@dataclass
class PeerPool:
    """Two staged nodes, R=1, and the announcing one's view of the source's files."""

    mount: object  # the announcing node's Mount
    files: list[Path]  # the source's files
    paths: list[str]  # the same files under the mount
    client: object  # an OrderClient with them registered
    theirs: np.ndarray  # per file: its chunk is the other node's


def peer_pool(mounted, tmp_path, dlfs_cli, chunk_size: str, *extra: str) -> PeerPool:
    """pool_source_tree populated with `chunk_size` chunks, mounted on two nodes (R=1)
    with `extra`, both shares staged, every file registered on the second node."""
    from conftest import populate_store
    from test_pool import Cluster, pool_source_tree, wait_staged

    source = pool_source_tree(tmp_path / "src")
    store = populate_store(source, tmp_path / "store", "ds", chunk_size, "--no-fsync")
    holder, mount = Cluster(mounted, store, tmp_path, 2, extra=extra).mounts
    wait_staged(dlfs_cli, holder)
    wait_staged(dlfs_cli, mount)
    files = sorted(p for p in source.rglob("*") if p.is_file())
    paths = [str(mount.path / "ds" / p.relative_to(source)) for p in files]
    client = connect(paths)
    locality = client.locality()
    theirs = locality.chunk_node[locality.sample_chunk] != locality.node
    return PeerPool(mount, files, paths, client, theirs)


def read_in_order(pool: PeerPool, order: np.ndarray) -> None:
    """Read every file through the mount in `order`, each byte compared with the source."""
    for i in order:
        data = open(pool.paths[i], "rb").read()  # noqa: SIM115
        assert hashlib.sha256(data).digest() == \
            hashlib.sha256(pool.files[i].read_bytes()).digest()


@pytest.mark.parametrize("pipeline", ["on", "off"])
def test_in_a_pool_extents_staged_on_a_peer_are_fetched_ahead_into_the_node(
        mounted, tmp_path, dlfs_cli, pipeline):
    """Two nodes, R=1, the other node's share staged: the announcing node fetches the
    samples of the other node's chunks from it before its readers ask (into its
    PeerShare), the readers take them from there (look-ahead hits, shared reads) and
    every byte is the source's. With --lookahead-pipeline on a fetch thread's peer
    extents went out together (peer_batches); off (the default), one at a time."""
    from test_pool import fresh_status

    pool = peer_pool(mounted, tmp_path, dlfs_cli, "256K", "--lookahead-pipeline", pipeline)
    client, theirs, mount = pool.client, pool.theirs, pool.mount
    assert theirs.any() and (~theirs).any(), "both nodes must own some of the samples"
    order = np.random.default_rng(3).permutation(len(pool.paths))
    client.announce(0, order)
    ahead = min(int(theirs.sum()), 16)
    assert wait_for(lambda: client.status()["counters"]["bytes_prefetched_from_peers"] > 0
                    and client.status()["counters"]["peer_fetches"] >= ahead, 60), \
        client.status()
    read_in_order(pool, order)
    counters = stats(mount)
    assert counters["lookahead"]["fetch_errors"] == 0
    assert counters["mount"]["lookahead"]["hits"] > 0
    batches = counters["lookahead"]["peer_batches"]
    assert batches > 0 if pipeline == "on" else batches == 0, counters["lookahead"]
    fetches = fresh_status(dlfs_cli, mount)["peer_fetch"]
    assert fetches["shared_reads"] > 0, fetches  # readers took peer bytes fetched ahead


def test_with_lookahead_peers_off_the_readers_fetch_what_only_peers_hold(
        mounted, tmp_path, dlfs_cli):
    """--lookahead-peers off: the look-ahead leaves the samples of the other node's
    chunks to the readers (no peer fetch of its own, each counted as left to them),
    still asks the page cache for this node's staged samples (hits), and every byte
    read is the source's, fetched from the peer by the readers."""
    from test_pool import fresh_status

    pool = peer_pool(mounted, tmp_path, dlfs_cli, "256K", "--lookahead-peers", "off")
    client, theirs, mount = pool.client, pool.theirs, pool.mount
    assert theirs.any() and (~theirs).any(), "both nodes must own some of the samples"
    order = np.random.default_rng(4).permutation(len(pool.paths))
    client.announce(0, order)
    window = min(len(order), 256)  # the default --lookahead: it waits for the readers
    assert wait_for(lambda: client.status()["counters"]["samples_prefetched"] >= window,
                    60), client.status()
    read_in_order(pool, order)
    counters = stats(mount)["lookahead"]
    assert counters["peer_fetches"] == 0 and counters["bytes_prefetched_from_peers"] == 0
    assert counters["extents_left_to_peers"] >= int(theirs.sum()), counters
    assert stats(mount)["mount"]["lookahead"]["hits"] > 0  # its own staged samples
    fetches = fresh_status(dlfs_cli, mount)["peer_fetch"]
    assert fetches["fetches"] >= int(theirs.sum()), fetches  # the readers fetched them


def test_a_window_larger_than_the_peer_share_fetches_each_extent_once(
        mounted, tmp_path, dlfs_cli):
    """Two nodes, R=1, 1 MiB chunks, a window of 2000 samples but 8 MiB, so the node's
    PeerShare has 72 slots (64 MiB of the readers' own + 8 MiB, a 1 MiB slot each)
    for the ~300 samples of the other node's chunks. One slow reader in the announced
    order: the look-ahead must not fetch past what the slots keep. It used to: its
    unread extents were evicted by its own later ones and the reader fetched them
    again (328 and 635 fetches for 207 and 383 samples here; 4,261 for 2,384 in
    bench/lookahead_peer.py --read 8)."""
    from test_pool import fresh_status

    pool = peer_pool(mounted, tmp_path, dlfs_cli, "1M", "--lookahead", "2000:8M")
    mount, theirs = pool.mount, pool.theirs
    slots = fresh_status(dlfs_cli, mount)["peer_fetch"]["slots"]
    # ~300 expected; 72 or fewer only if the other node owns at most 1 of ~15 chunks
    assert theirs.sum() > slots, (int(theirs.sum()), slots)
    order = np.random.default_rng(5).permutation(len(pool.paths))
    pool.client.announce(0, order)
    read_in_order(pool, order)
    fetches = fresh_status(dlfs_cli, mount)["peer_fetch"]
    peer_samples = int(theirs.sum())
    assert fetches["fetches"] <= peer_samples * 1.05, (fetches, peer_samples)
    assert fetches["shared_reads"] >= peer_samples * 0.8, (fetches, peer_samples)
    assert stats(mount)["lookahead"]["fetch_errors"] == 0


def test_reads_of_staged_chunks_fetched_ahead_count_as_hits(mounted, la_store, tmp_path):
    """With a node cache the look-ahead asks staged copies into the page cache; the
    readers' reads of them are hits (they were all counted as misses before)."""
    mount = mounted(la_store, "--cache-dir", str(tmp_path / "cache"))
    paths = mount_paths(mount)[:100]
    client = connect(paths)

    def staged() -> bool:
        status = json.loads(run_dlfs("status", mount.path, "--json").stdout)
        return all(d["staging"]["staged_chunks"] == d["staging"]["owned_chunks"]
                   for d in status["datasets"])

    assert wait_for(staged, 60)
    client.announce(0, np.arange(len(paths)))
    assert wait_for(lambda: client.status()["counters"]["samples_prefetched"] >= len(paths))
    for p in paths:
        open(p, "rb").read()  # noqa: SIM115
    taken = stats(mount)["mount"]["lookahead"]
    assert (taken["hits"], taken["misses"]) == (len(paths), 0), taken


def test_the_lookahead_opens_more_streams_while_the_readers_catch_up(
        mounted, la_store, la_source):
    mount = mounted(la_store, "--store-bandwidth", "4M", "--lookahead-streams", "2:16")
    paths = mount_paths(mount)
    client = connect(paths)
    order = np.random.default_rng(2).permutation(FILES)
    client.announce(0, order)
    readers = 4  # each its share of the order, as DataLoader workers

    def read_share(k: int) -> list[tuple[int, bytes]]:
        return [(i, hashlib.sha256(Path(paths[i]).read_bytes()).digest())
                for i in order[k::readers]]

    with ThreadPoolExecutor(readers) as pool:
        got = [d for share in pool.map(read_share, range(readers)) for d in share]
    assert sorted(i for i, _ in got) == list(range(FILES))
    for i, digest in got:
        assert digest == hashlib.sha256((la_source / f"f{i:04d}").read_bytes()).digest()
    counters = stats(mount)["lookahead"]
    assert counters["fetch_width_grown"] >= 1, counters
    assert counters["fetch_width"] > 2, counters
    assert client.status()["width_bounds"] == [2, 16]


def test_a_lookahead_with_no_reader_behind_it_keeps_its_least_width(mounted, la_store):
    mount = mounted(la_store, "--store-bandwidth", "4M", "--lookahead-streams", "2:16",
                    "--lookahead", "60")
    client = connect(mount_paths(mount))
    client.announce(0, np.arange(FILES))
    assert wait_for(lambda: client.status()["counters"]["samples_prefetched"] >= 60)
    time.sleep(0.5)  # a few periods of the width's control with the window full
    status = client.status()
    assert status["counters"]["fetch_width_grown"] == 0, status
    assert status["width"] == 2, status


@pytest.mark.parametrize("value", ["0", "9:4", "a:8", "4:", "0:3"])
def test_lookahead_streams_takes_min_max_and_refuses_the_rest_in_one_line(
        value, la_store, tmp_path):
    result = run_dlfs("mount", str(la_store), str(tmp_path / "m"),
                      "--lookahead-streams", value)
    assert result.returncode == 2
    assert "--lookahead-streams" in result.stderr and "MIN" in result.stderr


def test_the_window_counts_what_is_held_not_the_span_from_the_slowest_reader(
        mounted, la_store, la_source):
    """A DataLoader's workers spread over the order: here one sample is never read (a
    worker far behind); the look-ahead must go on fetching for the others, where a
    window counted from the slowest reader stopped one window past it."""
    mount = mounted(la_store, "--store-bandwidth", "16M", "--lookahead", "20")
    paths = mount_paths(mount)
    client = connect(paths)
    order = np.random.default_rng(3).permutation(FILES)
    client.announce(0, order)
    for i in order[1:]:
        data = open(paths[i], "rb").read()  # noqa: SIM115
        assert data == (la_source / f"f{i:04d}").read_bytes()
    counters = stats(mount)
    assert counters["lookahead"]["samples_prefetched"] >= FILES // 2, counters["lookahead"]
    assert counters["mount"]["lookahead"]["hits"] >= FILES // 2, counters["mount"]

"""The chunk pool with real daemons: several mounts on one machine, real TCP on loopback.

Each simulated node is a `dlfs mount` with its own mountpoint, cache dir and
port. Expected placements come from dlfs.cluster.placement (tested on its own in
test_placement.py); expected bytes always come from the source tree.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import describe_result, kill_daemon_of

from dlfs.cluster.placement import owners
from dlfs.demo.sampledata import generate_large_files, generate_tree
from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfs.store.store import Store

pytestmark = pytest.mark.usefixtures("daemon_guard")


# -- fixtures and helpers -------------------------------------------------------------
def pool_source_tree(root: Path) -> Path:
    """~600 small samples plus a few files that span several extents and chunks."""
    generate_tree(root / "train", 600, 20 * 1024, files_per_dir=200, seed=7)
    generate_large_files(root / "big", 3, 900 * 1024, seed=8)
    return root


@pytest.fixture(scope="module")
def pool_source(tmp_path_factory) -> Path:
    return pool_source_tree(tmp_path_factory.mktemp("pool") / "src")


@pytest.fixture(scope="module")
def pool_store(pool_source, tmp_path_factory) -> Path:
    from conftest import populate_store

    return populate_store(pool_source, tmp_path_factory.mktemp("pool-store") / "store", "ds",
                          "256K", "--no-fsync")


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_secret(path: Path, value: bytes | None = None) -> Path:
    path.write_bytes((value or secrets.token_hex(32).encode()) + b"\n")
    path.chmod(0o600)
    return path


def source_files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def status_of(dlfs_cli, mount) -> dict:
    result = dlfs_cli("status", mount.path, "--json")
    assert result.returncode == 0, describe_result(result)
    return json.loads(result.stdout)


def fresh_status(dlfs_cli, mount) -> dict:
    """A status written after now (the daemon rewrites it every second)."""
    since = time.time()
    deadline = time.monotonic() + 10
    while True:
        status = status_of(dlfs_cli, mount)
        if status["updated"] > since:
            return status
        assert time.monotonic() < deadline, "the daemon stopped updating its status"
        time.sleep(0.1)


def fresh_sources(dlfs_cli, mount) -> dict:
    return fresh_status(dlfs_cli, mount)["datasets"][0]["sources"]


def wait_staged(dlfs_cli, mount, timeout: float = 60.0) -> dict:
    """Poll `dlfs status` until every owned chunk is staged; returns that status."""
    deadline = time.monotonic() + timeout
    while True:
        status = status_of(dlfs_cli, mount)
        st = status["datasets"][0]["staging"]
        if st["staged_chunks"] == st["owned_chunks"]:
            return status
        assert time.monotonic() < deadline, f"staging did not finish: {st}"
        time.sleep(0.2)


def staged_chunks(cache_dir: Path) -> set[int]:
    return {int(p.name.split(".")[0]) for p in cache_dir.glob("*/*.chunk")}


def staged_data_bytes(cache_dir: Path) -> int:
    """Data bytes of the published copies in a cache dir (headers not counted)."""
    return sum(p.stat().st_size - CHUNK_HEADER_SIZE for p in cache_dir.glob("*/*.chunk"))


def wait_new_copy(path: Path, inode_before: int, timeout: float = 60.0) -> None:
    """Poll until `path` is a published copy other than the inode it was."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if path.stat().st_ino != inode_before:
                return
        except FileNotFoundError:
            pass  # evicted, not staged again yet
        assert time.monotonic() < deadline, f"{path} was not staged anew"
        time.sleep(0.1)


def read_and_compare(mount, source: Path, files: list[Path]) -> None:
    for rel in files:
        got = (Path(mount.path) / "ds" / rel).read_bytes()
        assert got == (source / rel).read_bytes(), f"wrong bytes for {rel} via {mount.path}"


class Cluster:
    """N simulated nodes: one mount each, sharing a node list and a secret."""

    def __init__(self, mounted, store: Path, base: Path, n: int, replicas: int = 1,
                 secrets_by_node: dict[int, Path] | None = None, extra=()) -> None:
        self.ports = free_ports(n)
        self.names = [f"n{i + 1}" for i in range(n)]
        self.nodes = ",".join(f"{name}=127.0.0.1:{port}"
                              for name, port in zip(self.names, self.ports, strict=True))
        self.caches = [base / f"cache-{name}" for name in self.names]
        secret = write_secret(base / "secret")
        self.mounts = []
        for i, name in enumerate(self.names):
            node_secret = (secrets_by_node or {}).get(i, secret)
            workers = "1" if i == 0 else "2"  # a node with the least workers there is, too
            self.mounts.append(mounted(
                store, "--cache-dir", str(self.caches[i]), "--nodes", self.nodes, "--node", name,
                "--replicas", str(replicas), "--secret-file", str(node_secret),
                "--workers", workers, "--peer-timeout", "2", *extra))


def expected_shares(store: Path, names: list[str], replicas: int) -> list[set[int]]:
    d = Store(store).open("ds")
    table = owners(d.uuid, d.chunk_count, names, replicas)
    return [set(np.flatnonzero((table == i).any(axis=1)).tolist()) for i in range(len(names))]


# -- tests ------------------------------------------------------------------------------
def test_three_nodes_read_identical_and_stage_only_their_share(
        mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    cluster = Cluster(mounted, pool_store, tmp_path, 3)
    shares = expected_shares(pool_store, cluster.names, 1)
    files = source_files(pool_source)
    for i, mount in enumerate(cluster.mounts):
        wait_staged(dlfs_cli, mount)
        assert staged_chunks(cluster.caches[i]) == shares[i], f"{cluster.names[i]} staged "
    for mount in cluster.mounts:
        read_and_compare(mount, pool_source, files)
    total = sum(p.stat().st_size for p in (pool_source / f for f in files))
    # One status of each node written after every read (each such wait costs up to 1 s
    # and a few CLI runs: asked for once, not three times).
    statuses = [fresh_status(dlfs_cli, m) for m in cluster.mounts]
    for i, status in enumerate(statuses):
        sources = status["datasets"][0]["sources"]
        assert sources["store"]["requests"] == 0, f"{cluster.names[i]} went to the store"
        assert sources["peer"]["bytes"] > 0 and sources["local"]["bytes"] > 0
        # Every byte read once, from exactly one source (files are read once per mount).
        assert sources["local"]["bytes"] + sources["peer"]["bytes"] == total
    served = [s["peer_server"] for s in statuses]
    fetched = sum(s["datasets"][0]["sources"]["peer"]["bytes"] for s in statuses)
    # Servers send whole extents; two workers may each fetch one a partial read needs.
    assert sum(s["bytes_served"] for s in served) >= fetched > 0
    assert all(s["bytes_served"] > 0 and s["auth_failures"] == 0 for s in served)
    # The reads are over, so the counters stand still: the plain view shows the same.
    served_by_n2 = served[1]["reads_served"]
    text = dlfs_cli("status", cluster.mounts[1].path)  # not a terminal: plain lines
    assert text.returncode == 0, describe_result(text)
    line = next(x for x in text.stdout.splitlines() if x.startswith("peer server:"))
    assert line.startswith(f"peer server: {served_by_n2} reads served"), line
    assert "0 auth failures" in line and served_by_n2 > 0, line


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_killed_peer_costs_no_failed_read(mounted, pool_store, pool_source, tmp_path,
                                            dlfs_cli, replicas):
    cluster = Cluster(mounted, pool_store, tmp_path, 3, replicas=replicas)
    for mount in cluster.mounts:
        wait_staged(dlfs_cli, mount)
    reader, victim = cluster.mounts[0], cluster.mounts[2]
    files = source_files(pool_source)
    random.Random(replicas).shuffle(files)
    errors: list[str] = []
    killed = threading.Event()

    def kill_victim() -> None:
        kill_daemon_of(victim)
        killed.set()

    for k, rel in enumerate(files):
        if k == len(files) // 10:
            kill_victim()
        try:
            got = (Path(reader.path) / "ds" / rel).read_bytes()
        except OSError as err:
            errors.append(f"{rel}: {err}")
            continue
        if got != (pool_source / rel).read_bytes():
            errors.append(f"{rel}: wrong bytes")
    assert killed.is_set() and errors == []
    sources = fresh_sources(dlfs_cli, reader)
    if replicas == 2:
        assert sources["store"]["requests"] == 0, "a replica should have served the lost chunks"
    else:
        assert sources["store"]["requests"] > 0, "the lost node's chunks must come from the store"
    assert "peer n3" in reader.log_text()  # the failure was noticed and logged


def test_wrong_secret_gets_no_data_and_reads_still_succeed(
        mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    intruder_secret = write_secret(tmp_path / "other-secret")
    cluster = Cluster(mounted, pool_store, tmp_path, 3, secrets_by_node={2: intruder_secret})
    for mount in cluster.mounts:
        wait_staged(dlfs_cli, mount)
    intruder = cluster.mounts[2]
    read_and_compare(intruder, pool_source, source_files(pool_source))
    sources = fresh_sources(dlfs_cli, intruder)
    assert sources["peer"]["requests"] == 0 and sources["store"]["requests"] > 0
    honest = [fresh_status(dlfs_cli, m)["peer_server"] for m in cluster.mounts[:2]]
    assert sum(s["auth_failures"] for s in honest) >= 1
    # The intruder's own server refuses the honest nodes too: they fall back cleanly.
    read_and_compare(cluster.mounts[0], pool_source, source_files(pool_source))


def test_flipped_byte_in_staged_chunk_is_detected_and_restaged(
        mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    cache = tmp_path / "cache"
    mount = mounted(pool_store, "--cache-dir", str(cache), "--workers", "2")
    wait_staged(dlfs_cli, mount)
    victim = pool_source / "big" / source_files(pool_source / "big")[0]
    d = Store(pool_store).open("ds")
    row = d.directory.resolve(os.fsencode(victim.relative_to(pool_source)))
    ext = d.directory.first_extent(row)
    chunk = int(d.directory.ext_chunk_view[ext])
    chunk_file = next(cache.glob(f"*/{chunk:08d}.chunk"))
    inode_before = chunk_file.stat().st_ino
    pos = CHUNK_HEADER_SIZE + int(d.directory.ext_offset_view[ext]) + 10
    with open(chunk_file, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert (Path(mount.path) / "ds" / victim.relative_to(pool_source)).read_bytes() == \
        victim.read_bytes()
    assert "checksum mismatch in staged chunk" in mount.log_text()
    # Evicted, then staged again: a copy under the same name, a new file, the right byte.
    wait_new_copy(chunk_file, inode_before)
    with open(chunk_file, "rb") as f:
        f.seek(pos)
        assert f.read(1) == byte, "the copy staged anew holds the flipped byte"
    read_and_compare(mount, pool_source, source_files(pool_source))


def test_reads_during_staging_are_correct_and_remount_reuses_staged_chunks(
        mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    cache = tmp_path / "cache"
    # A slow store (1 MiB/s per stream): reads start long before staging ends.
    mount = mounted(pool_store, "--cache-dir", str(cache), "--store-bandwidth", "1M")
    files = source_files(pool_source)
    random.Random(3).shuffle(files)
    read_and_compare(mount, pool_source, files[:150])
    assert fresh_sources(dlfs_cli, mount)["store"]["requests"] > 0
    st = status_of(dlfs_cli, mount)["datasets"][0]["staging"]
    assert st["staged_chunks"] < st["owned_chunks"]
    wait_staged(dlfs_cli, mount, timeout=120)
    read_and_compare(mount, pool_source, files[150:])
    inodes = {p.name: p.stat().st_ino for p in cache.glob("*/*.chunk")}
    # Staged copies are the daemon's alone (they used to be 0755 dirs, 0644 files:
    # readable by anyone on the node, whatever the store's or the mount's modes).
    assert {oct(d.stat().st_mode & 0o777) for d in cache.iterdir()} == {"0o700"}
    assert {oct(p.stat().st_mode & 0o777) for p in cache.glob("*/*.chunk")} == {"0o600"}
    result = dlfs_cli("umount", mount.path)
    assert result.returncode == 0, describe_result(result)

    again = mounted(pool_store, "--cache-dir", str(cache), mountpoint=Path(mount.path))
    st = status_of(dlfs_cli, again)["datasets"][0]["staging"]
    assert st["staged_chunks"] == st["owned_chunks"], "staged chunks should be reused"
    assert {p.name: p.stat().st_ino for p in cache.glob("*/*.chunk")} == inodes
    read_and_compare(again, pool_source, files)
    assert fresh_sources(dlfs_cli, again)["store"]["requests"] == 0


def test_cache_limit_stages_what_fits(mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    cache = tmp_path / "cache"
    limit = 1 << 20
    mount = mounted(pool_store, "--cache-dir", str(cache), "--cache-limit", "1M")
    lengths = Store(pool_store).open("ds").chunk_lengths.tolist()  # a lone node owns all
    assert min(lengths) <= limit < sum(lengths), "the limit must let some chunks in, not all"
    # Staging is over once no chunk left out would fit beside the staged ones.
    deadline = time.monotonic() + 60
    while True:
        on_disk = staged_chunks(cache)
        staged = sum(lengths[c] for c in on_disk)
        left_out = [n for c, n in enumerate(lengths) if c not in on_disk]
        if not left_out or staged + min(left_out) > limit:
            break
        assert time.monotonic() < deadline, (
            f"staging stopped with chunks {sorted(on_disk)} ({staged} bytes) staged, yet a "
            f"left-out chunk of {min(left_out)} bytes fits in the {limit}-byte limit")
        time.sleep(0.2)
    assert 0 < staged_data_bytes(cache) <= limit
    read_and_compare(mount, pool_source, source_files(pool_source))
    # Demands of the reads are held to the limit too.
    assert 0 < staged_data_bytes(cache) <= limit
    st = fresh_status(dlfs_cli, mount)["datasets"][0]["staging"]
    assert st["staged_bytes"] == staged_data_bytes(cache) and st["staged_chunks"] < len(lengths)


def test_a_remount_with_a_lower_cache_limit_drops_what_no_longer_fits(
        mounted, pool_store, tmp_path, dlfs_cli):
    cache = tmp_path / "cache"
    mount = mounted(pool_store, "--cache-dir", str(cache))
    wait_staged(dlfs_cli, mount)
    assert dlfs_cli("umount", mount.path).returncode == 0
    assert staged_data_bytes(cache) > 1 << 20
    again = mounted(pool_store, "--cache-dir", str(cache), "--cache-limit", "1M",
                    mountpoint=Path(mount.path))
    assert 0 < staged_data_bytes(cache) <= 1 << 20
    st = status_of(dlfs_cli, again)["datasets"][0]["staging"]
    assert st["staged_chunks"] < st["owned_chunks"]


def test_mount_refuses_a_secret_others_can_read(mounted, pool_store, tmp_path):
    secret = write_secret(tmp_path / "secret")
    secret.chmod(0o644)
    result = mounted.try_mount(pool_store, "--cache-dir", str(tmp_path / "c"),
                               "--nodes", "a=127.0.0.1:1,b=127.0.0.1:2", "--node", "a",
                               "--secret-file", str(secret))
    assert result.returncode == 2
    assert "chmod 600" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--nodes", "a=127.0.0.1:7001"], "need --cache-dir"),
    (["--verify-served"], "need --cache-dir"),
    (["--scrub-rate", "1M"], "need --cache-dir"),
    (["--peer-procs", "2"], "need --cache-dir"),
    (["--cache-dir", "C", "--nodes", "a=127.0.0.1:70000"], "bad port"),
    (["--cache-dir", "C", "--nodes", "a=127.0.0.1:7001,a=127.0.0.1:7002"], "listed twice"),
    (["--cache-dir", "C", "--nodes", "a=127.0.0.1:7001,b=127.0.0.1:7001", "--node", "a"],
     "same address"),
    (["--cache-dir", "C", "--nodes", "a=127.0.0.1:7001", "--node", "b"], "not in the node list"),
    (["--cache-dir", "C", "--nodes", "a=127.0.0.1:7001,b=127.0.0.1:7002", "--node", "a"],
     "needs --secret-file"),
    (["--cache-dir", "C", "--replicas", "2"], "exceeds"),
])
def test_bad_cluster_flags_fail_with_one_line(mounted, pool_store, tmp_path, args, message):
    args = [str(tmp_path / "c") if a == "C" else a for a in args]
    result = mounted.try_mount(pool_store, *args)
    assert result.returncode == 2, describe_result(result)
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_placement_command_matches_what_daemons_stage(pool_store, dlfs_cli):
    result = dlfs_cli("placement", "--store", pool_store, "ds", "--nodes",
                      "n1=h:1,n2=h:2,n3=h:3")
    assert result.returncode == 0, describe_result(result)
    shares = expected_shares(pool_store, ["n1", "n2", "n3"], 1)
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:]}
    assert [int(rows[n][2]) for n in ("n1", "n2", "n3")] == [len(s) for s in shares]


def test_copies_of_datasets_this_mount_does_not_use_are_reported(mounted, pool_store, tmp_path):
    """A re-populated dataset gets a new uuid: its old copies stay in the cache dir,
    counted against no limit. The mount says how much lies there (it does not delete:
    a cache dir may be another mount's too)."""
    cache = tmp_path / "cache"
    stale = cache / ("ab" * 16)
    stale.mkdir(parents=True)
    (stale / "00000000.chunk").write_bytes(b"x" * 300_000)
    (cache / "not-a-dataset").mkdir()  # not a uuid: not ours to judge
    mount = mounted(pool_store, "--cache-dir", str(cache))
    warnings = [line for line in mount.log_text().splitlines()
                if "dataset directories this mount does not use" in line]
    assert len(warnings) == 1, warnings
    assert "in 1 dataset directories" in warnings[0] and "293.0 KiB" in warnings[0]
    assert (stale / "00000000.chunk").exists()


# -- one peer fetch per node ----------------------------------------------------------------
@pytest.fixture(scope="module")
def large_store(tmp_path_factory) -> tuple[Path, Path]:
    """Files of several 4 MiB extents each (16 MiB chunks), whose last extent is short:
    read sequentially, the kernel's read-ahead cuts each extent into 1 MiB requests that
    reach different worker processes at once. Returns (source, store)."""
    from conftest import populate_store

    root = tmp_path_factory.mktemp("pool-large") / "src"
    generate_large_files(root, 3, (14 << 20) + 12345, seed=9)
    store = populate_store(root, tmp_path_factory.mktemp("pool-large-store") / "store", "ds",
                           "16M", "--no-fsync")
    return root, store


def test_a_node_fetches_each_extent_from_its_peer_once_however_many_workers_read_it(
        mounted, large_store, tmp_path, dlfs_cli):
    """Four workers read large files sequentially; the peer serves each extent once.

    The reading node owns every chunk too (2 replicas) but may stage none of them
    (--cache-limit 1), so every byte comes from the holder's staged copies."""
    source, store = large_store
    ports = free_ports(2)
    nodes = f"reader=127.0.0.1:{ports[0]},holder=127.0.0.1:{ports[1]}"
    secret = write_secret(tmp_path / "secret")
    common = ("--nodes", nodes, "--replicas", "2", "--secret-file", str(secret))
    holder = mounted(store, "--cache-dir", str(tmp_path / "cache-holder"), "--node", "holder",
                     "--workers", "2", *common)
    reader = mounted(store, "--cache-dir", str(tmp_path / "cache-reader"), "--node", "reader",
                     "--cache-limit", "1", "--workers", "4", *common)
    wait_staged(dlfs_cli, holder)
    files = source_files(source)
    for rel in files:  # one process, 1 MiB reads in file order, like `cat`
        with open(Path(reader.path) / "ds" / rel, "rb", buffering=0) as f:
            got = b"".join(iter(lambda f=f: f.read(1 << 20), b""))
        assert got == (source / rel).read_bytes(), f"wrong bytes for {rel}"
    d = Store(store).open("ds").directory
    needed = sum(d.size(d.resolve(os.fsencode(rel))) for rel in files)
    extents = sum(len(d.extents(d.resolve(os.fsencode(rel)))) for rel in files)
    assert extents > 2 * len(files) and d.extent_size == 4 << 20
    served = fresh_status(dlfs_cli, holder)["peer_server"]
    # Once per extent: the holder sent exactly the bytes the files hold.
    assert (served["reads_served"], served["bytes_served"]) == (extents, needed)
    status = fresh_status(dlfs_cli, reader)
    fetched = status["peer_fetch"]
    assert (fetched["fetches"], fetched["fetched_bytes"]) == (extents, needed)
    sources = status["datasets"][0]["sources"]
    assert sources["peer"]["bytes"] == needed and sources["store"]["requests"] == 0


# -- bad copies heal at once ----------------------------------------------------------------
def flip_byte(path: Path, pos: int) -> bytes:
    """Flip one byte of a staged copy behind the daemon's back (bit rot); returns it."""
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))
    return byte


def a_held_file(store: Path, source: Path, names: list[str], holder: int) -> tuple[Path, int]:
    """A one-extent file in a chunk only node `holder` owns: (its path in the source, the
    position of its bytes in that chunk's staged copy)."""
    d = Store(store).open("ds").directory
    share = expected_shares(store, names, 1)[holder]
    for rel in source_files(source):
        exts = d.extents(d.resolve(os.fsencode(rel)))
        if len(exts) == 1 and int(d.ext_chunk_view[exts[0]]) in share:
            return rel, CHUNK_HEADER_SIZE + int(d.ext_offset_view[exts[0]])
    pytest.fail(f"node {names[holder]} owns no chunk with a one-extent file")


def held_copy(cache: Path, store: Path, rel: Path) -> Path:
    d = Store(store).open("ds").directory
    chunk = int(d.ext_chunk_view[d.extents(d.resolve(os.fsencode(rel)))[0]])
    return next(cache.glob(f"*/{chunk:08d}.chunk"))


def drop_from_page_cache(path: Path) -> None:
    """Make the next read of a file through the mount reach the daemon again."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_copy_that_went_bad_after_its_check_is_reported_and_restaged_at_once(
        mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    """The holder's own reader checked the extent, then a byte of its copy flipped. A
    peer that reads it gets wrong bytes, reads the store instead and reports the range;
    the holder re-checks, evicts and re-stages the copy within seconds (it used to serve
    it for the rest of the job), and serves right bytes again."""
    cluster = Cluster(mounted, pool_store, tmp_path, 2)
    holder, reader = cluster.mounts  # the reader has two workers: the blocking client
    for mount in cluster.mounts:
        wait_staged(dlfs_cli, mount)
    rel, pos = a_held_file(pool_store, pool_source, cluster.names, 0)
    want = (pool_source / rel).read_bytes()
    assert (Path(holder.path) / "ds" / rel).read_bytes() == want  # checked there
    copy = held_copy(cluster.caches[0], pool_store, rel)
    inode = copy.stat().st_ino
    byte = flip_byte(copy, pos + 5)
    via_reader = Path(reader.path) / "ds" / rel
    assert via_reader.read_bytes() == want  # the peer's bytes failed: from the store
    wait_new_copy(copy, inode, timeout=30)
    with open(copy, "rb") as f:
        f.seek(pos + 5)
        assert f.read(1) == byte
    served = fresh_status(dlfs_cli, holder)["peer_server"]
    assert served["reports_confirmed"] >= 1 and served["protocol_errors"] == 0
    assert "reported it" in reader.log_text() and "evicted, staging it again" in holder.log_text()
    # The worker that got the bad bytes avoids that copy for 2 s; then the holder serves
    # the file again (right bytes: the reader checks them).
    deadline = time.monotonic() + 30
    while fresh_status(dlfs_cli, holder)["peer_server"]["reads_served"] == served["reads_served"]:
        assert time.monotonic() < deadline, "the holder never served the file again"
        drop_from_page_cache(via_reader)
        assert via_reader.read_bytes() == want
        time.sleep(0.2)


def test_verify_served_never_lets_a_bad_copy_out(
        mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    """With --verify-served the holder checks each extent the first time its copy serves
    it: a flip after its own reader's check is caught there, no peer sees wrong bytes."""
    cluster = Cluster(mounted, pool_store, tmp_path, 2, extra=("--verify-served",))
    holder, reader = cluster.mounts
    for mount in cluster.mounts:
        wait_staged(dlfs_cli, mount)
    rel, pos = a_held_file(pool_store, pool_source, cluster.names, 0)
    assert (Path(holder.path) / "ds" / rel).read_bytes() == (pool_source / rel).read_bytes()
    copy = held_copy(cluster.caches[0], pool_store, rel)
    inode = copy.stat().st_ino
    flip_byte(copy, pos)
    assert (Path(reader.path) / "ds" / rel).read_bytes() == (pool_source / rel).read_bytes()
    wait_new_copy(copy, inode, timeout=30)
    served = fresh_status(dlfs_cli, holder)["peer_server"]
    assert served["served_bad"] == 1 and served["served_checks"] >= 1
    assert "fail their checksum" not in reader.log_text()  # no wrong byte crossed
    read_and_compare(reader, pool_source, source_files(pool_source))


def test_scrub_finds_a_flipped_byte_in_a_copy_nobody_reads(
        mounted, pool_store, tmp_path, dlfs_cli):
    cache = tmp_path / "cache"
    mount = mounted(pool_store, "--cache-dir", str(cache), "--scrub-rate", "16M")
    wait_staged(dlfs_cli, mount)
    copy = sorted(cache.glob("*/*.chunk"))[1]
    inode = copy.stat().st_ino
    byte = flip_byte(copy, CHUNK_HEADER_SIZE + 1000)
    wait_new_copy(copy, inode, timeout=60)
    with open(copy, "rb") as f:
        f.seek(CHUNK_HEADER_SIZE + 1000)
        assert f.read(1) == byte
    scrub = fresh_status(dlfs_cli, mount)["scrub"]
    assert scrub["bad_copies"] == 1 and scrub["checked_bytes"] > 0
    assert "scrub: extent" in mount.log_text()
    sources = fresh_sources(dlfs_cli, mount)
    assert sources["local"]["requests"] == sources["store"]["requests"] == 0  # nobody read


def test_a_peer_not_up_yet_is_asked_again_soon_not_after_ten_seconds(
        mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    """A job step may read before every daemon of the job listens: n1 reads a file only
    n2 holds while n2 is not mounted yet (refused: from the store), then n2 comes up,
    and n1's next read of n2's chunks comes from n2, not from the store for the 10 s a
    peer that went down is skipped."""
    names = ["n1", "n2"]
    nodes = ",".join(f"{n}=127.0.0.1:{p}" for n, p in zip(names, free_ports(2), strict=True))
    secret = write_secret(tmp_path / "secret")
    d = Store(pool_store).open("ds").directory
    share = expected_shares(pool_store, names, 1)[1]
    held = [rel for rel in source_files(pool_source)
            if all(int(d.ext_chunk_view[e]) in share
                   for e in d.extents(d.resolve(os.fsencode(rel))))][:2]
    assert len(held) == 2, "n2 owns too few chunks in this dataset"

    def node(i: int):
        return mounted(pool_store, "--cache-dir", str(tmp_path / f"cache-{names[i]}"),
                       "--nodes", nodes, "--node", names[i], "--secret-file", str(secret),
                       "--workers", "1")

    n1 = node(0)
    read_and_compare(n1, pool_source, held[:1])
    refused_at = time.monotonic()
    before = fresh_sources(dlfs_cli, n1)
    assert before["store"]["requests"] > 0 and before["peer"]["requests"] == 0, before
    n2 = node(1)
    wait_staged(dlfs_cli, n2)
    took = time.monotonic() - refused_at
    if took > 8:
        pytest.skip(f"n2 took {took:.0f} s to come up here: too close to the 10 s a "
                    "peer that went down is skipped to tell the two apart")
    read_and_compare(n1, pool_source, held[1:])
    after = fresh_sources(dlfs_cli, n1)
    assert after["peer"]["bytes"] > 0, after
    assert after["store"]["requests"] == before["store"]["requests"], after
    assert "peer n2 is not up yet" in n1.log_text()

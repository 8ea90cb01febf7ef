"""A node cache shared by jobs in turn, under a node-wide limit (--node-cache-limit),
and a share larger than the cache (--cache-limit): real mounts, real staging.

The cache never holds more than the limit; the datasets earlier mounts left go
least recently used first; a dataset a running mount uses is never removed; a
share that does not fit is partly staged once and the rest read elsewhere,
epoch after epoch, without staging anything twice. Checkpoint tiers left in the
cache dir count against the limit and are never removed by it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import numpy as np
import pytest
from conftest import run_dlfs, tmpfs_at

from dlfs.store import nodecache
from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfs.store.store import Store

pytestmark = pytest.mark.usefixtures("daemon_guard")
FILE = 40_000


@pytest.fixture(scope="module")
def three(tmp_path_factory, store_with):
    """Datasets a, b, c of 30 files each, 64 KiB chunks."""
    store = tmp_path_factory.mktemp("nc-store") / "store"
    sources = {}
    for k, name in enumerate("abc"):
        src = tmp_path_factory.mktemp(f"nc-{name}")
        rng = np.random.default_rng(k)
        for i in range(30):
            (src / f"f{i:02d}").write_bytes(rng.bytes(FILE))
        store_with(src, name, "64K", store)
        sources[name] = src
    return store, sources


def staged_bytes(store, name: str) -> int:
    """What a dataset's staged copies take in a cache dir (each chunk with its header)."""
    d = Store(store).open(name)
    return int(d.chunk_lengths.sum()) + CHUNK_HEADER_SIZE * d.chunk_count


def status(mount) -> dict:
    return json.loads(run_dlfs("status", mount.path, "--json").stdout)


def wait_staged(mount) -> dict:
    """Until staging is over: all staged, or the rest skipped (over a limit) and the
    count unchanged for a second."""
    deadline = time.monotonic() + 60
    last, since = None, time.monotonic()
    while True:
        s = status(mount)
        counts = [d["staging"]["staged_chunks"] for d in s["datasets"]]
        if counts != last:
            last, since = counts, time.monotonic()
        if all(d["staging"]["staged_chunks"] == d["staging"]["owned_chunks"]
               for d in s["datasets"]) or time.monotonic() - since > 1.5:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def read_all(mount, name: str, source) -> None:
    for path in sorted(source.iterdir()):
        assert (mount.path / name / path.name).read_bytes() == path.read_bytes(), path


def forget_pages(mount, name: str) -> None:
    """Drop the mount's page cache of dataset `name`, so that the next epoch's reads
    reach the daemon: per file, not /proc/sys/vm/drop_caches, which would also drop
    what tests running beside this one (pytest-xdist) keep cached on purpose."""
    for path in (mount.path / name).iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cache_bytes(cache) -> int:
    return sum(d.bytes for d in nodecache.datasets(cache))


def test_jobs_in_turn_under_a_node_limit_evict_the_least_recently_used(
        mounted, three, tmp_path):
    store, sources = three
    cache = tmp_path / "cache"
    for name in "ab":  # two earlier jobs, a then b
        mount = mounted(store, "--dataset", name, "--cache-dir", str(cache))
        wait_staged(mount)
        assert run_dlfs("umount", mount.path).returncode == 0
        time.sleep(0.05)  # distinct last-use times
    limit = staged_bytes(store, "b") + staged_bytes(store, "c")
    mount = mounted(store, "--dataset", "c", "--cache-dir", str(cache),
                    "--node-cache-limit", str(limit))
    wait_staged(mount)
    read_all(mount, "c", sources["c"])
    uuids = {Store(store).open(n).uuid.hex(): n for n in "abc"}
    kept = sorted(uuids[d.uuid] for d in nodecache.datasets(cache))
    assert kept == ["b", "c"]  # a, the least recently used, went
    assert cache_bytes(cache) <= limit


def test_a_dataset_a_running_mount_uses_is_never_removed(mounted, three, tmp_path):
    store, sources = three
    cache = tmp_path / "cache"
    busy = mounted(store, "--dataset", "a", "--cache-dir", str(cache))
    wait_staged(busy)
    room = staged_bytes(store, "a") + staged_bytes(store, "b") // 2
    mount = mounted(store, "--dataset", "b", "--cache-dir", str(cache),
                    "--node-cache-limit", str(room))
    s = wait_staged(mount)
    uuids = {d.uuid for d in nodecache.datasets(cache)}
    assert Store(store).open("a").uuid.hex() in uuids
    assert cache_bytes(cache) <= room + 64 * 1024  # room is counted in whole chunks
    staging = s["datasets"][0]["staging"]
    assert 0 < staging["staged_chunks"] < staging["owned_chunks"]
    read_all(busy, "a", sources["a"])
    read_all(mount, "b", sources["b"])
    assert "this mount stages at most" in mount.log_text()


def test_a_share_larger_than_the_cache_is_staged_once_and_hits_stay_near_cache_over_share(
        mounted, three, tmp_path):
    store, sources = three
    total = staged_bytes(store, "c")
    mount = mounted(store, "--dataset", "c", "--cache-dir", str(tmp_path / "cache"),
                    "--cache-limit", str(total // 2))
    first = wait_staged(mount)["datasets"][0]["staging"]
    fraction = first["staged_bytes"] / first["owned_bytes"]  # data bytes, headers aside
    assert 0.3 < fraction < 0.6  # about half: a limit counts whole chunks
    for epoch in range(3):
        before = status(mount)["datasets"][0]["sources"]
        forget_pages(mount, "c")
        read_all(mount, "c", sources["c"])
        after = status_after(mount, before)
        local = after["local"]["bytes"] - before["local"]["bytes"]
        read = sum(after[s]["bytes"] - before[s]["bytes"] for s in after)
        assert abs(local / read - fraction) <= 0.1, (epoch, local, read, fraction)
    staging = status(mount)["datasets"][0]["staging"]
    assert staging["staged_chunks"] == first["staged_chunks"]  # nothing staged again


def status_after(mount, before: dict) -> dict:
    """The sources of a status written after the reads (it is rewritten every second)."""
    since = time.time()
    while True:
        s = status(mount)
        if s["updated"] > since:
            return s["datasets"][0]["sources"]
        time.sleep(0.1)


def test_other_users_cannot_read_a_node_cache(mounted, three, tmp_path):
    """The node cache outlives jobs of many users: only root (the daemons) reads it;
    users get the bytes through their own job's mount."""
    from sysusers import temp_user

    store, _ = three
    cache = tmp_path / "cache"
    tmp_path.chmod(0o755)  # let the user reach the cache dir itself, so the test is its mode
    mount = mounted(store, "--dataset", "a", "--cache-dir", str(cache))
    wait_staged(mount)
    [dataset] = nodecache.datasets(cache)
    chunk = next(p for p in dataset.path.iterdir() if not p.name.startswith("."))
    with temp_user() as user:
        for target in (["ls", str(dataset.path)], ["cat", str(chunk)]):
            denied = user.run(*target)
            assert denied.returncode != 0 and "Permission denied" in denied.stderr, target


def test_status_tells_cache_hits_from_earlier_jobs_from_what_this_job_staged(
        mounted, three, tmp_path):
    """Job 1 stages about half of dataset a (--cache-limit); job 2 adopts that half at
    mount, stages the rest itself, and its reads of the adopted half are counted as
    cache hits from earlier jobs, byte for byte."""
    store, sources = three
    cache = tmp_path / "cache"
    d = Store(store).open("a")
    job1 = mounted(store, "--dataset", "a", "--cache-dir", str(cache),
                   "--cache-limit", str(staged_bytes(store, "a") // 2))
    wait_staged(job1)
    assert run_dlfs("umount", job1.path).returncode == 0
    kept = {int(p.name.split(".")[0]) for p in (cache / d.uuid.hex()).glob("*.chunk")}
    assert 0 < len(kept) < d.chunk_count
    job2 = mounted(store, "--dataset", "a", "--cache-dir", str(cache))
    wait_staged(job2)
    read_all(job2, "a", sources["a"])
    since = time.time()
    while (s := status(job2))["updated"] <= since:  # written after the reads
        time.sleep(0.1)
    entry = s["datasets"][0]["node_cache"]
    ext_chunk = d.directory.arrays["ext_chunk"]
    in_kept = np.isin(ext_chunk, sorted(kept))
    expected = int(d.directory.arrays["ext_length"][in_kept].sum())
    assert entry["adopted_at_mount"] == entry["adopted_chunks"] == len(kept), entry
    assert entry["adopted_bytes"] == int(d.chunk_lengths[sorted(kept)].sum()), entry
    assert entry["staged_now_chunks"] == d.chunk_count - len(kept), entry
    assert entry["bytes"] == expected > 0, entry
    assert entry["reads"] > 0, entry
    # Every byte was read locally; the adopted copies served their part of it.
    assert s["datasets"][0]["sources"]["local"]["bytes"] == sum(
        p.stat().st_size for p in sources["a"].iterdir())
    from prometheus_client.parser import text_string_to_metric_families

    metrics = {(m.name, tuple(sorted(m.labels.items()))): m.value
               for f in text_string_to_metric_families((job2.path / ".dlfs" / "metrics")
                                                       .read_text()) for m in f.samples}
    assert metrics[("dlfs_adopted_bytes_total", (("dataset", "a"),))] == expected
    text = run_dlfs("status", job2.path)
    line = next(x.strip() for x in text.stdout.splitlines() if "node cache:" in x)
    assert line.startswith(f"node cache: {len(kept)} chunks adopted from earlier jobs"), line
    assert f"{d.chunk_count - len(kept)} staged by this job" in line, line
    assert f"{entry['reads']} reads" in line, line


@contextlib.contextmanager
def _unmounting_first(mounter):
    """Unmount the block's mounts at its end, failed or not: a daemon holding its cache
    dir keeps the tmpfs under it busy (it would stay mounted after the test)."""
    try:
        yield
    finally:
        mounter.cleanup()


def test_a_cache_dir_on_a_full_disk_fails_staging_cleanly_and_reads_go_elsewhere(
        mounted, three, tmp_path):
    """n1's cache dir is a 256 KiB tmpfs (a few of dataset a's 64 KiB chunks fit), n2's
    an ordinary dir, --replicas 2: n1 stages what fits, then its stager stops on ENOSPC
    with one log line and tells n2, which waits for the chunks n1 was to pass on, that
    it will not stage them (FAIL not-staging): n2 copies them from the store at once
    (--replica-wait is far off); every read through n1 is right, the rest coming from its peer; no
    partial copy is left, and a later mount adopts exactly the whole copies."""
    from conftest import tmpfs_at
    from test_pool import free_ports, write_secret
    from test_pool import wait_staged as wait_all_staged

    store, sources = three
    d = Store(store).open("a")
    with tmpfs_at(tmp_path / "nvme", "size=256k") as small, _unmounting_first(mounted):
        caches = [small / "cache", tmp_path / "cache-n2"]
        nodes = ",".join(f"n{i + 1}=127.0.0.1:{p}" for i, p in enumerate(free_ports(2)))
        secret = write_secret(tmp_path / "secret")
        started = time.monotonic()
        n1, n2 = (mounted(store, "--dataset", "a", "--cache-dir", str(caches[i]), "--nodes",
                          nodes, "--node", f"n{i + 1}", "--replicas", "2", "--secret-file",
                          str(secret), "--replica-wait", "600") for i in range(2))
        wait_all_staged(run_dlfs, n2)
        replication = status(n2)["replication"]
        assert replication["fallback_declined"] > 0, replication
        assert replication["fallback_slow"] == replication["fallback_down"] == 0, replication
        first = wait_staged(n1)["datasets"][0]["staging"]  # settles: the rest cannot fit
        assert 0 < first["staged_chunks"] < first["owned_chunks"], first
        read_all(n1, "a", sources["a"])
        since = time.time()
        while (s := status(n1))["updated"] <= since:
            time.sleep(0.1)
        got = s["datasets"][0]["sources"]
        assert got["peer"]["bytes"] > 0 and got["store"]["bytes"] == 0, got
        assert got["local"]["bytes"] + got["peer"]["bytes"] == sum(
            p.stat().st_size for p in sources["a"].iterdir())
        paused = [line for line in n1.log_text().splitlines() if "staging paused" in line]
        # One line per backoff step (the first retry comes 10 s after the first failure).
        allowed = 1 + sum(time.monotonic() - started > t for t in (10, 30, 70))
        assert 1 <= len(paused) <= allowed, paused
        assert "No space left" in paused[0] and str(caches[0]) in paused[0], paused[0]
        assert "Traceback" not in n1.log_text()
        assert run_dlfs("umount", n1.path).returncode == 0
        assert run_dlfs("umount", n2.path).returncode == 0
        held = caches[0] / d.uuid.hex()
        assert not [p.name for p in held.iterdir() if p.name.startswith(".tmp-")], \
            "a failed copy was left behind"
        whole = sorted(held.glob("*.chunk"))
        assert len(whole) == first["staged_chunks"]
        for path in whole:
            chunk = int(path.name.split(".")[0])
            assert path.read_bytes() == d.chunk_path(chunk).read_bytes(), path
        later = mounted(store, "--dataset", "a", "--cache-dir", str(caches[0]))
        entry = status(later)["datasets"][0]["node_cache"]
        assert entry["adopted_at_mount"] == len(whole), entry
        read_all(later, "a", sources["a"])
        assert run_dlfs("umount", later.path).returncode == 0


def test_an_undrained_checkpoint_tier_counts_against_the_node_limit_and_is_never_removed(
        mounted, three, tmp_path):
    """A job's checkpoint could not drain (its store is read-only) and stays in the cache
    dir beside dataset a's copies. The next mount's node limit fits a and c but not the
    tier too: a goes, the tier stays byte-exact, and `dlfs cache ls` shows it undrained."""
    store, sources = three
    cache = tmp_path / "cache"
    payload = np.random.default_rng(7).bytes(600_000)
    with tmpfs_at(tmp_path / "ckstore", "ro,size=4m") as ckstore:
        job = mounted(store, "--dataset", "a", "--cache-dir", str(cache),
                      "--ckpt-store", str(ckstore))
        wait_staged(job)
        (job.path / "ckpt" / "step-1.pt").write_bytes(payload)
        assert run_dlfs("flush", job.path, "--timeout", "1").returncode == 1  # not drained
        assert run_dlfs("umount", job.path).returncode == 0
    tier = nodecache.ckpt_tiers(cache)
    assert len(tier) == 1 and tier[0].undrained == 1 and not tier[0].in_use, tier
    held = nodecache.ckpt_bytes(cache)
    assert held >= len(payload)

    limit = staged_bytes(store, "a") + staged_bytes(store, "c")  # no room for the tier too
    mount = mounted(store, "--dataset", "c", "--cache-dir", str(cache),
                    "--node-cache-limit", str(limit))
    wait_staged(mount)
    read_all(mount, "c", sources["c"])
    uuids = {Store(store).open(n).uuid.hex(): n for n in "abc"}
    assert sorted(uuids[d.uuid] for d in nodecache.datasets(cache)) == ["c"]  # a made room
    assert cache_bytes(cache) + held <= limit
    assert (tier[0].path / "tree" / "step-1.pt").read_bytes() == payload
    assert "checkpoint tiers in" in mount.log_text()

    pruned = run_dlfs("cache", "prune", "--cache-dir", cache, "--to-size", "0")
    assert pruned.returncode == 0 and "checkpoint tiers hold" in pruned.stdout, pruned.stdout
    assert (tier[0].path / "tree" / "step-1.pt").read_bytes() == payload
    listed = run_dlfs("cache", "ls", "--cache-dir", cache, "--json")
    rows = [r for r in json.loads(listed.stdout) if r["kind"] == "ckpt"]
    assert [(r["files"], r["undrained"], r["bytes"]) for r in rows] == [(1, 1, held)]
    assert rows[0]["store"] == str(ckstore)

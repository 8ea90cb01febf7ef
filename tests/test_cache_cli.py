"""`dlfs cache ls|prune`: a node cache dir as jobs leave it, with real mounts.

A mount holds its datasets' `.in-use` locks while it runs, so prune skips them;
after the unmount the copies stay (for the node's next job) until pruned,
least recently used first.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import run_dlfs
from trees import make_small_tree

from dlfs.store.store import Store

pytestmark = pytest.mark.usefixtures("daemon_guard")


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory, store_with):
    store = tmp_path_factory.mktemp("cache-store") / "store"
    for name, files in (("old", 6), ("new", 9)):
        src = tmp_path_factory.mktemp(f"cache-{name}")
        make_small_tree(src, files=files)
        store_with(src, name, "64K", store)
    return store


def staged(mount) -> None:
    deadline = time.monotonic() + 60
    while True:
        status = json.loads(run_dlfs("status", mount.path, "--json").stdout)
        if all(d["staging"]["staged_chunks"] == d["staging"]["owned_chunks"]
               for d in status["datasets"]):
            return
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def ls(cache, store) -> list[dict]:
    r = run_dlfs("cache", "ls", "--cache-dir", cache, "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_copies_outlive_the_mount_and_prune_skips_what_a_mount_uses(
        mounted, two_datasets, tmp_path, store_with):
    cache = tmp_path / "cache"
    mount = mounted(two_datasets, "--cache-dir", str(cache))
    staged(mount)
    rows = {r["dataset"]: r for r in ls(cache, two_datasets)}
    assert set(rows) == {"old", "new"} and all(r["in_use"] for r in rows.values())
    chunks = {name: Store(two_datasets).open(name).chunk_count for name in rows}
    assert {name: r["chunks"] for name, r in rows.items()} == chunks
    r = run_dlfs("cache", "prune", "--cache-dir", cache, "--to-size", "0")
    assert r.returncode == 0 and r.stdout.count("skipped") == 2, r.stdout
    assert len(ls(cache, two_datasets)) == 2

    assert run_dlfs("umount", mount.path).returncode == 0
    assert_named_without_store(cache, two_datasets, rows, store_with, tmp_path)
    rows = {r["dataset"]: r for r in ls(cache, two_datasets)}
    assert not any(r["in_use"] for r in rows.values())
    uuid_old, uuid_new = rows["old"]["uuid"], rows["new"]["uuid"]
    os.utime(cache / uuid_old / ".last-used", (time.time() - 86400 * 3,) * 2)
    dry = run_dlfs("cache", "prune", "--cache-dir", cache, "--older-than", "2d", "--dry-run")
    assert dry.returncode == 0 and "would remove" in dry.stdout and uuid_old in dry.stdout
    assert len(ls(cache, two_datasets)) == 2  # a dry run removes nothing
    keep = rows["new"]["bytes"]  # the least recently used goes first
    r = run_dlfs("cache", "prune", "--cache-dir", cache, "--to-size", str(keep))
    assert r.returncode == 0, r.stderr
    assert [row["uuid"] for row in ls(cache, two_datasets)] == [uuid_new]
    r = run_dlfs("cache", "prune", "--cache-dir", cache, "--dataset", "new",
                 "--store", two_datasets)
    assert r.returncode == 0 and ls(cache, two_datasets) == []


def assert_named_without_store(cache, store, rows, store_with, tmp_path) -> None:
    """`cache ls` without --store names the datasets as their mount did (.dataset);
    with a store that lacks them, it says which they were."""
    bare = run_dlfs("cache", "ls", "--cache-dir", cache, "--json")
    assert bare.returncode == 0, bare.stderr
    assert {r["dataset"]: (r["uuid"], r["source"]) for r in json.loads(bare.stdout)} == {
        name: (row["uuid"], str(store / name)) for name, row in rows.items()}
    text = run_dlfs("cache", "ls", "--cache-dir", cache).stdout.splitlines()
    assert sorted(line.split(":")[0] for line in text[:2]) == sorted(
        f"{name} ({row['uuid']})" for name, row in rows.items())
    src = tmp_path / "other-src"
    make_small_tree(src, files=1)
    other = store_with(src, "other", "64K", tmp_path / "other-store")
    text = run_dlfs("cache", "ls", "--cache-dir", cache, "--store", other).stdout
    for name, row in rows.items():
        assert f"{row['uuid']} (not in the store, was {name})" in text, text


@pytest.mark.parametrize(("args", "message"), [
    (["prune"], "prune needs --dataset, --older-than or --to-size"),
    (["prune", "--older-than", "soon"], "must be a number with s, m, h or d"),
    (["prune", "--dataset", "imagenet"], "give --store to name datasets"),
])
def test_bad_cache_commands_get_one_line(tmp_path, args, message):
    (tmp_path / "cache").mkdir()
    r = run_dlfs("cache", args[0], "--cache-dir", tmp_path / "cache", *args[1:])
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_a_missing_cache_dir_is_one_line(tmp_path):
    r = run_dlfs("cache", "ls", "--cache-dir", tmp_path / "nope")
    assert r.returncode == 1 and "does not exist" in r.stderr

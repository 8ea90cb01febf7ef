"""The daemon on overlayfs: a container's root and /tmp, where a job may keep everything.

overlayfs lacks what the daemon likes to use: preadv(RWF_NOWAIT) fails with
EOPNOTSUPP (the reader and the peer server then read in threads), cachestat sees
no page cache, and copies (the stager's copy_file_range) and splices go through
to the files beneath. Here the source sits in the lower (image) layer, and the
store, the cache dir of a pool of one and the mountpoint are all on the overlay
this test mounts (and unmounts, with the DLFS mount inside it first, whatever
happens). Every byte is read twice: while staging runs, and once every chunk is
staged, with O_DIRECT so that the kernel's page cache of the mount cannot
answer and the staged copies on the overlay must. Skips where overlayfs cannot
be mounted (not root).
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

import pytest
from conftest import describe_result, overlayfs_at, populate_store
from pagecache import fs_type

from dlfs.demo.sampledata import generate_large_files, generate_tree

pytestmark = pytest.mark.usefixtures("daemon_guard")


def make_source(root: Path) -> None:
    """Small samples and a few files spanning several extents and chunks."""
    generate_tree(root / "train", 300, 20 * 1024, files_per_dir=100, seed=3)
    generate_large_files(root / "big", 2, 3 << 20, seed=4)


@pytest.fixture
def overlay(tmp_path):
    with overlayfs_at(tmp_path / "ovl", lambda lower: make_source(lower / "src")) as merged:
        assert fs_type(merged) == "overlay"
        yield merged


def source_files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def read_direct(path: Path) -> bytes:
    """The whole file through O_DIRECT: every byte is asked of the daemon, none comes
    from the kernel's page cache of the mount."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
    out = bytearray()
    try:
        while True:
            n = os.preadv(fd, [buf], len(out))
            out += buf[:n]
            if n < len(buf):
                return bytes(out)
    finally:
        buf.close()
        os.close(fd)


def status_of(dlfs_cli, path: Path) -> dict:
    result = dlfs_cli("status", path, "--json")
    assert result.returncode == 0, describe_result(result)
    return json.loads(result.stdout)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_pool_of_one_on_overlayfs_serves_every_byte(overlay, mounted, dlfs_cli, workers):
    """One worker process (the least there is) and two (the kernel's read-ahead hands
    parts of one extent to both), reading inline and splicing their replies."""
    src = overlay / "src"  # from the lower layer
    files = source_files(src)
    assert len(files) > 300
    store = populate_store(src, overlay / "store", "ds", "256K")
    cache, mountpoint = overlay / "cache", overlay / "mnt"
    mountpoint.mkdir()
    m = mounted(store, "--cache-dir", str(cache), "--workers", workers, mountpoint=mountpoint)
    for rel in files:  # while staging runs: from the store, or copies staged already
        assert (m.path / "ds" / rel).read_bytes() == (src / rel).read_bytes(), rel

    deadline = time.monotonic() + 120
    while True:
        staging = status_of(dlfs_cli, m.path)["datasets"][0]["staging"]
        if staging["staged_chunks"] == staging["owned_chunks"]:
            break
        assert time.monotonic() < deadline, f"staging did not finish: {staging}"
        time.sleep(0.2)
    dataset = next(d for d in cache.iterdir() if d.is_dir())
    staged = sorted(dataset.glob("*.chunk"))
    assert len(staged) == staging["owned_chunks"] > 1
    for copy in staged:  # the kernel's copy from overlay to overlay is exact
        assert copy.read_bytes() == (store / "ds" / "chunks" / copy.name).read_bytes()

    local_before = status_of(dlfs_cli, m.path)["datasets"][0]["sources"]["local"]["bytes"]
    for rel in files:  # every byte again, from the staged copies
        assert read_direct(m.path / "ds" / rel) == (src / rel).read_bytes(), rel
    deadline = time.monotonic() + 10  # the status file is rewritten every second
    total = sum((src / rel).stat().st_size for rel in files)
    while True:
        local = status_of(dlfs_cli, m.path)["datasets"][0]["sources"]["local"]["bytes"]
        if local - local_before >= total:
            break
        assert time.monotonic() < deadline, \
            f"only {local - local_before} of {total} bytes came from the staged copies"
        time.sleep(0.2)
    assert "Traceback" not in m.log_text(), m.log_text()

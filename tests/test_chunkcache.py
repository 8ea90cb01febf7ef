"""ChunkCache generations: a copy staged again after an eviction is a new generation.

Each process caches one open descriptor per staged chunk together with the
generation it opened; a changed generation makes it reopen. If a re-staged
copy got the generation of the evicted one, a process still holding the old
(unlinked, bad) file would keep reading it, find it bad and evict the good
copy, over and over (seen as an eviction storm in a test of the spliced path).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Store
from dlfsd.pool.chunkcache import ChunkCache


@pytest.fixture
def cache(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(np.random.default_rng(1).bytes(300_000))
    dataset = populate(src, Store(tmp_path / "store"), "ds",
                       PopulateOptions(chunk_size=256 << 10, fsync=False, progress=False))
    cache = ChunkCache(tmp_path / "cache", dataset)
    cache.dir.mkdir(parents=True)
    yield cache
    cache.close()


def stage(cache: ChunkCache, chunk: int) -> None:
    temp = cache.temp_path(chunk)
    shutil.copyfile(cache.dataset.chunk_path(chunk), temp)
    cache.publish(chunk, temp)


def test_restaged_copy_is_reopened_not_taken_for_the_evicted_one(cache):
    stage(cache, 0)
    old_fd = cache.open_fd(0)
    old_inode = os.fstat(old_fd).st_ino
    assert cache.cached_fd(0) == old_fd
    cache.evict(0)
    assert cache.cached_fd(0) == -1 and not cache.is_staged(0)
    stage(cache, 0)
    assert cache.cached_fd(0) == -1, "the old descriptor must not count for the new copy"
    new_fd = cache.open_fd(0)
    assert os.fstat(new_fd).st_ino != old_inode
    assert os.fstat(new_fd).st_ino == os.stat(cache.path(0)).st_ino


def test_fd_opens_once_reopens_a_new_copy_and_is_minus_one_when_absent(cache):
    """ChunkCache.fd is the one way to a staged copy's descriptor (reader, look-ahead,
    peer server, scrub): the same number while the copy stays, the new copy's after a
    re-staging, -1 (nothing opened) when the chunk is not staged."""
    assert cache.fd(0) == -1
    stage(cache, 0)
    first = cache.fd(0)
    assert first >= 0 and cache.fd(0) == first == cache.cached_fd(0)
    cache.evict(0)
    assert cache.fd(0) == -1
    stage(cache, 0)
    again = cache.fd(0)
    assert again != first
    assert os.fstat(again).st_ino == os.stat(cache.path(0)).st_ino


def test_generations_keep_changing_over_many_restagings(cache):
    stage(cache, 1)
    seen = cache.open_fd(1)
    for _ in range(300):  # past the one-byte wrap
        cache.evict(1)
        stage(cache, 1)
        assert cache.cached_fd(1) == -1
        seen = cache.open_fd(1)
        assert cache.cached_fd(1) == seen


def test_a_copy_removed_behind_our_back_is_forgotten_so_it_is_staged_again(cache):
    """Staged, then deleted by something else (a cleaner, an admin): opening it finds
    nothing, and the chunk must stop counting as staged (else it is never staged again
    and peers get MISS for good)."""
    stage(cache, 0)
    cache.path(0).unlink()
    assert cache.is_staged(0)
    assert cache.open_fd(0) == -1
    assert not cache.is_staged(0)


def test_a_superseded_copy_keeps_its_descriptor_until_close(cache):
    """A disk thread may still be reading the old copy: its fd number must not be handed
    out again (to the new copy or any file) while the cache lives."""
    stage(cache, 0)
    old_fd = cache.open_fd(0)
    cache.evict(0)
    stage(cache, 0)
    new_fd = cache.open_fd(0)
    assert new_fd != old_fd
    os.fstat(old_fd)  # still open
    cache.close()
    with pytest.raises(OSError):
        os.fstat(old_fd)


def test_a_scan_leaves_another_live_daemons_copy_in_progress(cache):
    """A node cache is shared by the node's daemons: a mount's scan removes temporary
    copies whose writer is gone, never one another daemon is writing right now."""
    import subprocess
    import sys

    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        name = cache.temp_path(0).name.rsplit(".", 1)[0]
        live_copy = cache.dir / f"{name}.{writer.pid}"
        dead_copy = cache.dir / f"{name}.{dead.pid}"
        for path in (live_copy, dead_copy):
            path.write_bytes(b"half a chunk")
        assert cache.scan() == 0
        assert live_copy.exists() and not dead_copy.exists()
    finally:
        writer.kill()
        writer.wait()

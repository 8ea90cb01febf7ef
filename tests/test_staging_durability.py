"""Staged copies are durable once published, and a failed copy is tried again.

A re-mount adopts staged copies by header and size alone, and with --no-verify
their bytes are trusted: a copy whose data was still only in the page cache
when it was renamed in could come back zero-filled after a crash and be served
as wrong bytes. The kernel tells whether a file still has data that never
reached the disk (cachestat: dirty and under-writeback pages), so that is what
is checked of a copy the real Stager published.

A copy that fails (the cache disk full for a moment, a bad store copy) must be
tried again after a backoff, not never again for the rest of the mount, and a
source that keeps failing must not make the stager spin: attempts are counted
as the kernel sees them (inotify opens of the store's chunk file).

Real objects throughout: a populated store, ChunkCaches in tmp_path (one on a
small tmpfs this test mounts and unmounts), the Stager under a real trio run
with its real copy threads; only its retry delays are shortened.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import trio
from conftest import chunked_dataset, tmpfs_at, until
from pagecache import cachestat, require

from dlfs.store.nodecache import ABOUT, IN_USE, LAST_USED
from dlfsd.pool import stager as stager_module
from dlfsd.pool.chunkcache import ChunkCache
from dlfsd.pool.stager import DemandChannel, Stager

FIRST, CAP = 0.05, 0.2  # the stager's retry delays in these tests (seconds)

_libc = ctypes.CDLL(None, use_errno=True)
_IN_OPEN, _IN_CLOSE_NOWRITE = 0x20, 0x10
_IN_NONBLOCK = os.O_NONBLOCK


def copies_and_temp_files(directory) -> list[str]:
    """What a cache dir holds besides the node cache's bookkeeping (.last-used, .in-use)."""
    return sorted(n for n in os.listdir(directory) if n not in (LAST_USED, IN_USE, ABOUT))



def unwritten_pages(path) -> int:
    """Pages of `path` the kernel has not written to the disk yet (dirty or in flight)."""
    require(Path(path).parent, "cachestat")
    fd = os.open(path, os.O_RDONLY)
    try:
        stat = cachestat(fd)
        return stat.nr_dirty + stat.nr_writeback
    finally:
        os.close(fd)


@contextlib.contextmanager
def opens_of(path):
    """Count the opens of `path` (inotify IN_OPEN) during the block: yields a callable.

    Closes are watched too: inotify merges an event into an identical one still
    unread, so opens would be counted once, closes in between keep them apart."""
    fd = _libc.inotify_init1(_IN_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    seen = 0

    def count() -> int:
        nonlocal seen
        with contextlib.suppress(BlockingIOError):
            while True:
                events = os.read(fd, 65536)
                pos = 0
                while pos < len(events):
                    _wd, mask, _cookie, name_len = struct.unpack_from("iIII", events, pos)
                    seen += bool(mask & _IN_OPEN)
                    pos += 16 + name_len
        return seen

    try:
        watched = _libc.inotify_add_watch(fd, os.fsencode(path), _IN_OPEN | _IN_CLOSE_NOWRITE)
        assert watched >= 0, os.strerror(ctypes.get_errno())
        yield count
    finally:
        os.close(fd)


@pytest.fixture
def dataset(tmp_path):
    """A dataset of a few 256 KiB chunks."""
    return chunked_dataset(tmp_path, files=3, seed=11)


@pytest.fixture
def fast_retries(monkeypatch):
    """The stager tries failed copies again after FIRST, 2 FIRST, ... up to CAP seconds."""
    monkeypatch.setattr(stager_module, "RETRY_FIRST", FIRST)
    monkeypatch.setattr(stager_module, "RETRY_MAX", CAP)


@pytest.fixture
def make_stager(dataset):
    """make(cache_root, owned) -> a Stager of `dataset`, closed afterwards."""
    made = []

    def make(cache_root, owned: np.ndarray) -> Stager:
        cache = ChunkCache(cache_root, dataset)
        cache.scan()
        stager = Stager([dataset], [cache], [owned], DemandChannel(), jobs=2)
        made.append(stager)
        return stager

    yield make
    for stager in made:
        stager.caches[0].close()
        stager.demand.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted in tmp_path (unmounted afterwards): a disk that fills up."""
    with tmpfs_at(tmp_path / "nvme", "size=1m") as where:
        yield where


def only(dataset, *chunks: int) -> np.ndarray:
    owned = np.zeros(dataset.chunk_count, dtype=bool)
    owned[list(chunks)] = True
    return owned


async def test_a_published_copy_has_no_data_left_that_never_reached_the_disk(
        dataset, make_stager, tmp_path):
    """Once the stager marks a chunk staged, every byte of the copy is on the disk: a
    crash right then cannot leave a right-sized copy of zeros that a re-mount adopts."""
    control = tmp_path / "cache-control"
    control.write_bytes(os.urandom(256 << 10))  # written, not synced
    if not unwritten_pages(control):
        pytest.skip("this file system writes at once: unsynced data cannot be told apart")
    stager = make_stager(tmp_path / "cache", only(dataset, 0))
    cache = stager.caches[0]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stager.run)
        assert await until(lambda: cache.is_staged(0), 5), "chunk 0 was never staged"
        nursery.cancel_scope.cancel()
    left = unwritten_pages(cache.path(0))
    if not unwritten_pages(control):  # written back meanwhile: `left` would prove nothing
        pytest.skip("the kernel wrote unsynced data back during the test")
    assert left == 0, f"{left} pages of the published copy were not on the disk yet"
    assert cache.path(0).read_bytes() == dataset.chunk_path(0).read_bytes()


async def test_a_copy_that_failed_on_a_full_cache_disk_is_staged_once_there_is_room(
        dataset, small_tmpfs, make_stager, fast_retries):  # the stager closes first
    """ENOSPC for a moment (another job's files not yet deleted) pauses staging for a
    backoff; it must not switch staging off for the rest of the mount."""
    stager = make_stager(small_tmpfs, only(dataset, 0))
    cache = stager.caches[0]
    filler = small_tmpfs / "other-job"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):  # no flush at close
        while True:
            f.write(b"x" * 65536)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stager.run)
        await trio.sleep(3 * CAP)  # several backoff steps on a full disk
        assert not cache.is_staged(0)
        assert copies_and_temp_files(cache.dir) == [], "a failed copy left a temp file behind"
        filler.unlink()  # room again
        staged = await until(lambda: cache.is_staged(0), 3 * CAP + 1)
        nursery.cancel_scope.cancel()
    assert staged, "chunk 0 was not staged again after the cache disk had room"
    assert cache.path(0).read_bytes() == dataset.chunk_path(0).read_bytes()


async def test_a_bad_store_copy_is_retried_with_backoff_and_staged_once_repaired(
        dataset, make_stager, tmp_path, caplog, fast_retries):
    """A truncated store chunk fails every copy: it is tried again after growing delays
    (not in a loop, not never), logged once per backoff step, and staged once the store
    copy is whole again."""
    source = dataset.chunk_path(1)
    whole = source.read_bytes()
    source.write_bytes(whole[: len(whole) // 2])
    stager = make_stager(tmp_path / "cache", only(dataset, 1))
    cache = stager.caches[0]
    caplog.set_level(logging.WARNING, logger=stager_module.__name__)
    with opens_of(source) as opens:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stager.run)
            await trio.sleep(1.0)  # FIRST, 2 FIRST, then CAP apart: about 7 attempts
            attempts = opens()
            assert not cache.is_staged(1)
            source.write_bytes(whole)  # repaired
            staged = await until(lambda: cache.is_staged(1), CAP + 1)
            nursery.cancel_scope.cancel()
    assert attempts >= 3, f"the failed copy was tried {attempts} times in 1 s: not retried"
    assert attempts <= 15, f"the failed copy was tried {attempts} times in 1 s: spinning"
    logged = [r for r in caplog.records if "chunk 1" in r.getMessage()]
    assert 1 <= len(logged) < attempts, [r.getMessage() for r in logged]
    assert staged, "chunk 1 was not staged after its store copy was repaired"
    assert cache.path(1).read_bytes() == whole


async def test_progress_does_not_promise_an_eta_for_what_the_cache_limit_keeps_out(
        dataset, make_stager, tmp_path):
    """With --cache-limit below the owned bytes, staging stops short; `dlfs status` must
    not show a fixed positive ETA for chunks that will never be staged."""
    owned = only(dataset, *range(dataset.chunk_count))
    cache = ChunkCache(tmp_path / "cache", dataset)
    cache.scan()
    one_chunk = int(dataset.chunk_lengths[0]) + 4096
    stager = Stager([dataset], [cache], [owned], DemandChannel(), jobs=2,
                    cache_limit=one_chunk)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stager.run)
            assert await until(lambda: stager.finished is not None and not stager._busy, 5)
            nursery.cancel_scope.cancel()
        (progress,) = stager.progress()
        assert 0 < progress.staged_chunks < progress.owned_chunks
        assert progress.eta is None, f"eta {progress.eta} s for chunks that do not fit"
    finally:
        cache.close()
        stager.demand.close()

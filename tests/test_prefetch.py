"""Chunk prefetch: reading one sample pulls its whole chunk file into the page cache.

Residency is checked from outside the daemon with mincore(2) on the store's
chunk files; they are evicted with posix_fadvise(DONTNEED) before each mount.
A page counts as pulled in if it was in the page cache at any moment: a watch
(tests/pagecache.py) asks mincore every few milliseconds from before the first
read, and counts the pages reclaim evicted meanwhile where the kernel can tell
(this VM's DAMON pageout evicts fresh pages in bulk; looking every 50 ms from
after the read, the test missed some: "24 pages never cached").
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest
from pagecache import ResidencyWatch, drop_pages, require

from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfs.store.store import Store
from dlfsd.core.prefetch import MEMORY_SHARE, ChunkPrefetch, prefetch_decision

FILE_SIZE = 100_000
FILES = 400  # 40 MB: three 16 MiB chunks, packed in name order


@pytest.fixture(scope="module")
def prefetch_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("prefetch-src")
    for i in range(FILES):
        (src / f"f{i:04d}").write_bytes(bytes([i % 251]) * FILE_SIZE)
    return store_with(src, "ds", "16M")


def chunk_files(store: Path) -> list[Path]:
    return sorted((store / "ds" / "chunks").iterdir())


def placement(store: Path) -> dict[str, tuple[int, int]]:
    """name -> (chunk, offset in its chunk) of every file (from the manifest)."""
    d = Store(store).open("ds").directory
    out = {}
    for i in range(FILES):
        row = d.lookup(0, f"f{i:04d}".encode())
        ext = d.first_extent(row)
        out[f"f{i:04d}"] = (int(d.ext_chunk_view[ext]), int(d.ext_offset_view[ext]))
    return out


def pick(store: Path, chunk: int, lo: float, hi: float) -> str:
    """A file of `chunk` that starts between fractions lo and hi of the chunk."""
    size = chunk_files(store)[chunk].stat().st_size
    for name, (c, offset) in sorted(placement(store).items()):
        if c == chunk and lo * size <= offset < hi * size:
            return name
    raise AssertionError(f"no file in chunk {chunk} between {lo} and {hi}")


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache; skip where the file system cannot."""
    require(paths[0].parent, "page residency")
    drop_pages(paths)


def wait_until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_store_has_three_chunks(prefetch_store):
    assert len(chunk_files(prefetch_store)) == 3


def test_first_read_pulls_in_its_whole_chunk_only(mounted, prefetch_store):
    chunks = chunk_files(prefetch_store)
    evict(chunks)
    name = pick(prefetch_store, 0, 0.4, 0.6)
    m = mounted(prefetch_store)
    with ResidencyWatch(chunks) as watch:
        assert (m.path / "ds" / name).read_bytes() == bytes([int(name[1:]) % 251]) * FILE_SIZE
        # Whole: the head too, which no read-ahead from the middle of the chunk covers.
        if not wait_until(lambda: not watch.never_cached(chunks[0])):
            gone = watch.never_cached(chunks[0])
            pytest.fail(f"the touched chunk was not read ahead: {len(gone)} pages never "
                        f"cached, first {gone[:5]}, last {gone[-5:]}")
        time.sleep(0.5)  # an untouched chunk stays out (its tail, past any kernel read-ahead)
        size = chunks[2].stat().st_size
        assert watch.ever_cached(chunks[2], size - (1 << 20), size) == []


def test_prefetch_off_reads_only_what_is_asked(mounted, prefetch_store):
    chunks = chunk_files(prefetch_store)  # chunk 1: not the one the test above pulled in
    size = chunks[1].stat().st_size
    evict(chunks)
    m = mounted(prefetch_store, "--prefetch", "off")
    # A file near the start of chunk 1: the kernel's own read-ahead (up to the disk's
    # read_ahead_kb, 8 MiB here) cannot reach the chunk's last MiB.
    name = pick(prefetch_store, 1, 0.0, 0.1)
    with ResidencyWatch(chunks[1:2]) as watch:
        assert (m.path / "ds" / name).read_bytes() == bytes([int(name[1:]) % 251]) * FILE_SIZE
        time.sleep(1.0)
        assert watch.ever_cached(chunks[1], size - (1 << 20), size) == []


def test_prefetch_log_line_says_why(mounted, prefetch_store):
    m = mounted(prefetch_store, "--prefetch", "off")
    assert "chunk prefetch switched off (--prefetch off)" in m.log.read_text()


@pytest.mark.parametrize(("args", "on", "why"), [
    (("auto", False, False, 1 << 30, 8 << 30), True, "on:"),
    (("off", False, False, 1 << 30, 8 << 30), False, "--prefetch off"),
    (("auto", True, False, 1 << 30, 8 << 30), False, "chunk pool"),
    (("auto", False, True, 1 << 30, 8 << 30), False, "throttled"),
    (("auto", False, False, (8 << 30) // MEMORY_SHARE + 1, 8 << 30), False, "exceed"),
])
def test_prefetch_decision(args, on, why):
    got, reason = prefetch_decision(*args)
    assert got is on and why in reason


MIB = 1 << 20


@pytest.fixture(scope="module")
def large_file_store(tmp_path_factory, store_with):
    """32 MiB chunks: 12 MiB of small files, a 40 MiB file (chunk 0 from 12 MiB on, chunk
    1 up to 20 MiB), then 12 MiB of small files (the rest of chunk 1)."""
    src = tmp_path_factory.mktemp("prefetch-large-src")
    for i in range(12):
        (src / f"a{i:02d}").write_bytes(bytes([i]) * MIB)
    (src / "b-large").write_bytes(os.urandom(40 * MIB))
    for i in range(12):
        (src / f"c{i:02d}").write_bytes(bytes([i]) * MIB)
    return src, store_with(src, "ds", "32M")


def file_ranges(store: Path, name: bytes) -> list[tuple[int, int, int]]:
    """(chunk, start, end) in chunk-file positions of each extent of file `name`."""
    d = Store(store).open("ds").directory
    row = d.lookup(0, name)
    first = d.first_extent(row)
    count = -(-d.size(row) // d.extent_size)
    return [(int(d.ext_chunk_view[e]), CHUNK_HEADER_SIZE + int(d.ext_offset_view[e]),
             CHUNK_HEADER_SIZE + int(d.ext_offset_view[e]) + int(d.ext_length_view[e]))
            for e in range(first, first + count)]


def test_large_file_prefetches_its_own_bytes_not_its_chunks(mounted, large_file_store):
    src, store = large_file_store
    chunks = chunk_files(store)
    extents = file_ranges(store, b"b-large")
    assert len(chunks) == 2 and {c for c, _, _ in extents} == {0, 1}
    assert extents[0][1] >= 12 * MIB  # the small files come first
    window = extents[:8]  # the first read queues a chunk size (32 MiB) of the file
    assert {c for c, _, _ in window} == {0, 1}
    evict(chunks)
    m = mounted(store)
    expected = (src / "b-large").read_bytes()[:MIB]
    with ResidencyWatch(chunks) as watch:
        with open(m.path / "ds" / "b-large", "rb") as f:  # one 1 MiB read at its start
            assert f.read(MIB) == expected
        # Every page of the window, in both chunks, cached at some point.

        def never_cached() -> list[tuple[int, int]]:
            return [(c, p) for c, lo, hi in window for p in watch.never_cached(chunks[c], lo, hi)]

        if not wait_until(lambda: not never_cached()):
            pytest.fail(f"the large file was not read ahead: {len(never_cached())} of its "
                        f"pages never cached")
        time.sleep(0.5)
        # Not its chunks: the small files before it in chunk 0 stay out (nothing reads
        # backwards from the file's start).
        head = 8 * MIB // mmap.PAGESIZE
        read = len(watch.ever_cached(chunks[0], 0, 8 * MIB))
        assert read <= 0.1 * head, f"{read} of the {head} head pages were read"


def test_large_file_ranges_come_a_window_at_a_time(large_file_store):
    """What a large file's reads queue: a window (a chunk size) of its bytes, per chunk
    merged (a chunk it continues into from the header on); halfway through a window the
    next one; no extent twice."""
    _, store = large_file_store
    dataset = Store(store).open("ds")
    d = dataset.directory
    row = d.lookup(0, b"b-large")
    size, first = d.size(row), d.first_extent(row)
    extents = file_ranges(store, b"b-large")  # 10 extents of 4 MiB: 5 in each chunk
    last = first + len(extents) - 1
    assert [c for c, _, _ in extents] == [0] * 5 + [1] * 5
    path0, path1 = (str(dataset.chunk_path(c)) for c in (0, 1))

    def fresh() -> tuple[ChunkPrefetch, list]:
        prefetch = ChunkPrefetch(dataset.chunk_count, dataset.chunk_size, d.extent_size,
                                 d.ext_chunk_view, d.ext_offset_view, d.ext_length_view,
                                 dataset.chunk_path)
        queued: list = []
        prefetch._put = queued.append  # what would go to the reading thread
        return prefetch, queued

    prefetch, queued = fresh()
    try:
        prefetch.touch(first, 0, last, size)
        assert queued == [[(path0, extents[0][1], extents[4][2], False),
                           (path1, 0, extents[7][2], False)]]
        for e in (first, first + 1, first + 3, first + 7):  # inside the window: nothing
            prefetch.touch(e, 0, last, size)
        assert len(queued) == 1
        prefetch.touch(first + 4, 0, last, size)  # halfway: the rest of the file
        assert queued[1:] == [[(path1, extents[8][1], extents[9][2], False)]]
        prefetch.touch(first + 4, 0, last, size)
        prefetch.touch(first + 9, 0, last, size)
        assert len(queued) == 2
    finally:
        prefetch.close()
    prefetch, queued = fresh()  # a read in chunk 1 first, then one at the file's start
    try:
        prefetch.touch(first + 5, 0, last, size)
        prefetch.touch(first, 0, last, size)
        assert queued == [[(path1, extents[5][1], extents[9][2], False)],
                          [(path0, extents[0][1], extents[4][2], False)]]
    finally:
        prefetch.close()

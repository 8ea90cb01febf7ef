"""Spliced read replies: ReplySplicer against real pipes and files, and a real mount.

The splicer's target is the FUSE device in a worker; here a pipe stands in for
it where we need to see the exact bytes of a reply (splice into a pipe works
like splice into /dev/fuse: the whole reply in one call). The mount tests
then check the worker path end to end: spliced reads are byte-identical to
the source, and a chunk file cut short after its bytes were verified gives
EIO, never short or stale data.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import random
import struct
import termios
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagecache import require

from dlfs.errors import CorruptDataError
from dlfs.pipes import PIPE_BYTES
from dlfs.store.format import checksum
from dlfsd.core.reader import _map_and_hash
from dlfsd.fuse.splicer import ReplySplicer, SpliceFailed

PAGE = os.sysconf("SC_PAGE_SIZE")
TEST_PIPE = 1 << 20  # any process may make a pipe this large; the logic is size-independent
PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")


@pytest.fixture
def splicing_allowed():
    """Workers splice only 1 MiB reads, which need 2 MiB pipes: root with
    CAP_SYS_RESOURCE may make them anyway; for the CI VM (root without it) raise
    fs.pipe-max-size for the test and put it back."""
    before = int(PIPE_MAX_SIZE.read_text())
    if before < PIPE_BYTES:
        PIPE_MAX_SIZE.write_text(str(PIPE_BYTES))
    try:
        yield
    finally:
        if before < PIPE_BYTES:
            PIPE_MAX_SIZE.write_text(str(before))


def assert_splicing(m) -> None:
    assert "1 MiB read replies spliced from chunk files" in m.log_text(), m.log_text()


@pytest.fixture
def data_file(tmp_path):
    """A chunk-like file in tmp_path: (fd, bytes, path)."""
    blob = random.Random(7).randbytes(3 << 20)
    path = tmp_path / "chunk"
    path.write_bytes(blob)
    fd = os.open(path, os.O_RDONLY)
    yield fd, blob, path
    os.close(fd)


@pytest.fixture
def target():
    """A pipe standing in for /dev/fuse: (write end for the splicer, read end to check)."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
    yield w, r
    os.close(r)
    os.close(w)


@pytest.fixture
def splicer(target, tmp_path):
    """A ReplySplicer whose "device" is the target pipe (its read end is target[1]).
    Skips where the file system under tmp_path (data_file's) cannot splice from its
    files: the daemon copies there instead, which the mount tests cover."""
    require(tmp_path, "splice")
    splicer = ReplySplicer(target[0], TEST_PIPE)
    yield splicer
    splicer.close()


def read_reply(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        out += os.read(fd, n - len(out))
    return out


def pipe_is_empty(fd: int) -> bool:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] == 0


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pos=st.integers(0, (2 << 20) - 1), length=st.integers(1, 600 << 10))
def test_reply_is_header_then_exact_file_bytes(data_file, target, splicer, pos, length):
    fd, blob, _ = data_file
    check = target[1]
    header = struct.pack("<IiQ", 16 + length, 0, pos)
    splicer.send(header, fd, pos, length)
    assert read_reply(check, 16 + length) == header + blob[pos : pos + length]
    assert pipe_is_empty(check)


def test_fit_counts_the_header_and_unaligned_pages(splicer):
    assert splicer.capacity > 0, "this machine must allow at least a 1 MiB pipe"
    slots = (splicer.capacity + 2 * PAGE) // PAGE
    most = (slots - 1) * PAGE  # aligned data: every slot but the header's
    assert splicer.fits(0, most)
    assert not splicer.fits(0, most + 1)
    assert not splicer.fits(1, most)  # unaligned: one page more
    assert splicer.fits(1, most - PAGE)
    assert splicer.fits(PAGE - 1, splicer.capacity)


def test_too_large_a_reply_sends_nothing(data_file, target, splicer):
    fd, blob, _ = data_file
    length = splicer.capacity + 2 * PAGE
    with pytest.raises(SpliceFailed, match="do not fit"):
        splicer.send(b"h" * 16, fd, 0, min(length, len(blob)))
    assert pipe_is_empty(target[1])


def test_short_file_fails_and_leaves_no_half_reply(data_file, target, splicer):
    fd, blob, _ = data_file
    check = target[1]
    with pytest.raises(SpliceFailed, match="ends before"):
        splicer.send(b"H" * 16, fd, len(blob) - 100, 4096)
    assert pipe_is_empty(check), "a failed reply must not reach the device"
    splicer.send(b"G" * 16, fd, 10, 5000)  # the next reply is clean
    assert read_reply(check, 5016) == b"G" * 16 + blob[10:5010]
    assert pipe_is_empty(check)


# -- through a real mount -----------------------------------------------------------
def _tree(root: Path) -> dict[str, bytes]:
    rng = random.Random(11)
    files = {f"big{i}.bin": rng.randbytes(rng.randrange(3 << 20, 9 << 20)) for i in range(3)}
    files.update({f"mid{i}.bin": rng.randbytes(rng.randrange(40 << 10, 300 << 10))
                  for i in range(20)})
    root.mkdir(parents=True)
    for name, blob in files.items():
        (root / name).write_bytes(blob)
    return files


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", ["splice", "no-splice"])
def test_mount_reads_equal_source_with_and_without_splice(tmp_path, store_with, mounted, mode,
                                                          splicing_allowed):
    files = _tree(tmp_path / "src")
    store = store_with(tmp_path / "src", "ds", "4M")
    m = mounted(store, *([] if mode == "splice" else ["--no-splice"]))
    if mode == "splice":
        assert_splicing(m)
    rng = random.Random(5)
    for rnd in range(2):  # the second round reads verified extents: the spliced path
        for name, blob in files.items():
            path = m / "ds" / name
            _drop_page_cache(path)
            with open(path, "rb", buffering=0) as f:
                got = f.read()
            assert hashlib.sha256(got).digest() == hashlib.sha256(blob).digest(), (rnd, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                for _ in range(5):  # random ranges (page cache or not, any alignment)
                    off = rng.randrange(len(blob))
                    n = rng.randrange(1, 3 << 20)
                    assert os.pread(fd, n, off) == blob[off : off + n], (name, off, n)
            finally:
                os.close(fd)
    assert "Traceback" not in m.log_text()


def test_chunk_cut_short_after_verification_reads_eio(tmp_path, store_with, mounted,
                                                      splicing_allowed):
    src = tmp_path / "src"
    src.mkdir()
    blob = random.Random(3).randbytes(2 << 20)
    (src / "one.bin").write_bytes(blob)
    store = store_with(src, "ds", "4M")
    m = mounted(store)
    assert_splicing(m)
    path = m / "ds" / "one.bin"
    assert path.read_bytes() == blob  # verified now: later 1 MiB reads are spliced
    chunk = next((store / "ds").rglob("*.chunk"))
    os.truncate(chunk, chunk.stat().st_size - (1 << 20))
    _drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # one 1 MiB request per pread
        assert os.pread(fd, 1 << 20, 0) == blob[: 1 << 20]  # still within the file
        with pytest.raises(OSError) as err:
            os.pread(fd, 1 << 20, 1 << 20)
        assert err.value.errno == errno.EIO
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", ["splice", "no-splice"])
def test_flipped_byte_in_a_large_file_reads_eio_when_checked_in_place(tmp_path, store_with,
                                                                      mounted, splicing_allowed,
                                                                      mode):
    """A first 1 MiB read of a 3 MiB extent checks the extent mapped, not copied out
    (spliced or not): a flipped byte must still be caught."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(9)
    bad, good = rng.randbytes(3 << 20), rng.randbytes(3 << 20)
    (src / "a.bin").write_bytes(bad)
    (src / "b.bin").write_bytes(good)
    store = store_with(src, "ds", "4M")
    chunks = sorted((store / "ds").rglob("*.chunk"))
    data = bytearray(chunks[0].read_bytes())
    at = data.find(bad[1 << 20 : (1 << 20) + 64])  # a.bin's second MiB, in the chunk
    assert at > 0
    data[at + 5] ^= 0xFF
    chunks[0].write_bytes(data)
    m = mounted(store, *([] if mode == "splice" else ["--no-splice"]))
    if mode == "splice":
        assert_splicing(m)
    fd = os.open(m / "ds" / "a.bin", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # just the range we ask for
        with pytest.raises(OSError) as err:  # a first read that would be spliced: the
            os.pread(fd, 1 << 20, 1 << 20)  # 3 MiB extent is checked in place (mapped)
        assert err.value.errno == errno.EIO
    finally:
        os.close(fd)
    assert (m / "ds" / "b.bin").read_bytes() == good
    assert "checksum mismatch" in m.log_text()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pos=st.integers(0, (3 << 20) - 1), length=st.integers(0, 3 << 20))
def test_extent_checked_in_place_hashes_like_a_copied_one(data_file, pos, length):
    fd, blob, _ = data_file
    length = min(length, len(blob) - pos)
    assert _map_and_hash(fd, length, pos)[1] == checksum(blob[pos : pos + length])


def test_extent_checked_in_place_past_the_end_is_an_error_not_sigbus(data_file):
    fd, blob, _ = data_file
    with pytest.raises(CorruptDataError, match="truncated"):
        _map_and_hash(fd, 1 << 20, len(blob) - 100)


def _wait_staged(dlfs_cli, mount, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = dlfs_cli("status", mount.path, "--json")
        assert result.returncode == 0, result.stderr
        staging = json.loads(result.stdout)["datasets"][0]["staging"]
        if staging["staged_chunks"] == staging["owned_chunks"]:
            return
        assert time.monotonic() < deadline, f"staging did not finish: {staging}"
        time.sleep(0.2)


def test_staged_copy_cut_short_is_evicted_and_the_spliced_read_still_correct(
        tmp_path, store_with, mounted, dlfs_cli, splicing_allowed):
    """Spliced from a staged copy (node-local NVMe) once verified; when that copy is cut
    short, the failed splice is read again the copying way, which evicts the copy and
    serves the bytes from the store: right bytes, not EIO."""
    src = tmp_path / "src"
    src.mkdir()
    blob = random.Random(4).randbytes(3 << 20)
    (src / "a.bin").write_bytes(blob)
    store = store_with(src, "ds", "4M")
    cache = tmp_path / "cache"
    # The daemon's own spliced reads are under test: a 3 MiB file is "large" here, and
    # on a kernel with passthrough the mount would let the kernel read it instead.
    m = mounted(store, "--cache-dir", str(cache), "--passthrough", "off")
    assert_splicing(m)
    _wait_staged(dlfs_cli, m)
    path = m / "ds" / "a.bin"
    assert path.read_bytes() == blob  # checks the staged copy: later reads are spliced
    staged = next(cache.rglob("*.chunk"))
    os.truncate(staged, staged.stat().st_size - (2 << 20))
    # O_DIRECT: exactly one 1 MiB READ reaches the daemon, and no page-by-page retry
    # by the kernel could hide a failed answer.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 1 << 20)
    try:
        assert os.preadv(fd, [buf], 2 << 20) == 1 << 20
        assert buf[:] == blob[2 << 20 :]
    finally:
        buf.close()
        os.close(fd)
    log = m.log_text()
    assert "cannot splice a read reply" in log and "evicted, re-staging" in log, log
    assert log.count("evicted, re-staging") == 1, "a re-staged copy was evicted again"

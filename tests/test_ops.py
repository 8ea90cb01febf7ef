"""The FUSE operations driven directly under trio: no kernel, real store and reader."""

from __future__ import annotations

import errno
import os
import stat

import pyfuse3
import pytest
import trio

import dlfsd.reader as reader_module
from dlfs.store.format import CHUNK_HEADER_SIZE, checksum
from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Store
from dlfsd.fuse.ops import DlfsOperations
from dlfsd.namespace import FIRST_DATASET_INODE, ROOT_INODE, Namespace

FILES = {
    b"a.bin": os.urandom(5000),
    b"empty": b"",
    b"sub/big.bin": os.urandom(3 * 4096 + 17),
    b"sub/\xffodd": b"odd name",
}


@pytest.fixture
def store(tmp_path):
    src = tmp_path / "src"
    for rel, data in FILES.items():
        path = os.path.join(os.fsencode(src), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.symlink("a.bin", src / "link")
    store = Store(tmp_path / "store")
    options = PopulateOptions(chunk_size=4096, jobs=2, fsync=False, progress=False)
    populate(src, store, "ds", options)
    populate(src / "sub", store, "other", options)
    return store


def make_ops(store: Store, verify: bool = True, namespace_cls=Namespace) -> DlfsOperations:
    datasets = [store.open(n) for n in store.dataset_names()]
    return DlfsOperations(namespace_cls(datasets, trio.CapacityLimiter(4), verify))


async def resolve(ops: DlfsOperations, path: bytes) -> int:
    ino = ROOT_INODE
    for part in path.split(b"/"):
        ino = (await ops.lookup(ino, part)).st_ino
    return ino


async def read_all(ops: DlfsOperations, ino: int, size: int, step: int) -> bytes:
    fi = await ops.open(ino, os.O_RDONLY)
    out = b"".join([bytes(await ops.read(fi.fh, off, step)) for off in range(0, size + 1, step)])
    await ops.release(fi.fh)
    return out


async def test_every_file_reads_back_exactly(store):
    ops = make_ops(store)
    for rel, data in FILES.items():
        ino = await resolve(ops, b"ds/" + rel)
        for step in (1000, 4096, 65536):
            assert await read_all(ops, ino, len(data), step) == data


async def test_reads_at_odd_offsets_and_past_eof(store):
    ops = make_ops(store)
    data = FILES[b"sub/big.bin"]
    ino = await resolve(ops, b"ds/sub/big.bin")
    for off, size in [(4090, 20), (8191, 2), (0, 1 << 20), (len(data) - 1, 10), (len(data), 10)]:
        assert bytes(await ops.read(ino, off, size)) == data[off : off + size]


async def test_attributes(store):
    ops = make_ops(store)
    root = await ops.getattr(ROOT_INODE)
    assert stat.S_ISDIR(root.st_mode) and root.st_nlink == 4
    ds = await ops.lookup(ROOT_INODE, b"ds")
    assert ds.st_ino == FIRST_DATASET_INODE  # datasets are laid out by name: ds, other
    f = await ops.getattr(await resolve(ops, b"ds/a.bin"))
    assert (f.st_size, stat.S_ISREG(f.st_mode), f.st_uid) == (5000, True, os.getuid())
    link = await resolve(ops, b"ds/link")
    assert stat.S_ISLNK((await ops.getattr(link)).st_mode)
    assert await ops.readlink(link) == b"a.bin"


@pytest.mark.parametrize("call, code", [
    (lambda ops: ops.lookup(ROOT_INODE, b"nope"), errno.ENOENT),
    (lambda ops: ops.getattr(10**9), errno.ENOENT),
    (lambda ops: ops.getattr(7), errno.ENOENT),  # reserved control range
    (lambda ops: ops.open(ROOT_INODE, os.O_RDONLY), errno.EISDIR),
    (lambda ops: ops.opendir(FIRST_DATASET_INODE + 1, None), errno.ENOTDIR),
    (lambda ops: ops.open(FIRST_DATASET_INODE + 1, os.O_WRONLY), errno.EROFS),
    (lambda ops: ops.open(FIRST_DATASET_INODE + 1, os.O_RDWR | os.O_TRUNC), errno.EROFS),
    (lambda ops: ops.write(FIRST_DATASET_INODE + 1, 0, b"x"), errno.EROFS),
    (lambda ops: ops.mkdir(ROOT_INODE, b"d", 0o755, None), errno.EROFS),
    (lambda ops: ops.unlink(FIRST_DATASET_INODE, b"a.bin", None), errno.EROFS),
    (lambda ops: ops.rename(FIRST_DATASET_INODE, b"a", FIRST_DATASET_INODE, b"b", 0, None),
     errno.EROFS),
    (lambda ops: ops.setattr(FIRST_DATASET_INODE, None, None, None, None), errno.EROFS),
    (lambda ops: ops.create(FIRST_DATASET_INODE, b"n", 0o644, os.O_WRONLY, None), errno.EROFS),
    (lambda ops: ops.setxattr(FIRST_DATASET_INODE, b"user.x", b"1", None), errno.EROFS),
    (lambda ops: ops.readlink(FIRST_DATASET_INODE + 1), errno.ENOENT),
])
async def test_errno_mapping(store, call, code):
    ops = make_ops(store)
    with pytest.raises(pyfuse3.FUSEError) as info:
        await call(ops)
    assert info.value.errno == code


async def test_lookup_through_a_file_is_enotdir(store):
    ops = make_ops(store)
    ino = await resolve(ops, b"ds/a.bin")
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.lookup(ino, b"x")
    assert info.value.errno == errno.ENOTDIR


def _flip_first_byte(store: Store, rel: bytes) -> None:
    d = store.open("ds")
    ext = d.directory.first_extent(d.directory.resolve(rel))
    path = d.chunk_path(d.directory.ext_chunk_view[ext])
    pos = CHUNK_HEADER_SIZE + d.directory.ext_offset_view[ext]
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))


async def test_corrupt_extent_reads_eio_and_others_survive(store, caplog):
    _flip_first_byte(store, b"a.bin")
    ops = make_ops(store)
    bad = await resolve(ops, b"ds/a.bin")
    for _ in range(2):
        with pytest.raises(pyfuse3.FUSEError) as info:
            await ops.read(bad, 100, 10)  # a read anywhere in the extent checks all of it
        assert info.value.errno == errno.EIO
    mismatches = [r for r in caplog.records if "checksum mismatch" in r.getMessage()]
    assert len(mismatches) == 1 and "a.bin" in mismatches[0].getMessage()
    good = await resolve(ops, b"ds/sub/big.bin")
    assert await read_all(ops, good, len(FILES[b"sub/big.bin"]), 4096) == FILES[b"sub/big.bin"]


async def test_concurrent_first_reads_share_one_verified_load(store):
    ops = make_ops(store)
    ino = await resolve(ops, b"ds/sub/big.bin")
    data = FILES[b"sub/big.bin"]
    results = {}

    async def one(off):
        results[off] = bytes(await ops.read(ino, off, 1000))

    async with trio.open_nursery() as nursery:
        for off in range(0, len(data), 1000):
            nursery.start_soon(one, off)
    assert b"".join(results[o] for o in sorted(results)) == data


async def test_unexpected_exception_becomes_eio_and_is_logged(store, caplog):
    class Broken(Namespace):
        async def read(self, ino, offset, size):
            raise RuntimeError("boom")

    ops = make_ops(store, namespace_cls=Broken)
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.read(FIRST_DATASET_INODE + 1, 0, 10)
    assert info.value.errno == errno.EIO
    logged = [r for r in caplog.records if r.levelname == "ERROR" and r.exc_info]
    assert len(logged) == 1 and isinstance(logged[0].exc_info[1], RuntimeError)


async def test_readdir_offsets_are_stable(store):
    datasets = [store.open(n) for n in store.dataset_names()]
    ns = Namespace(datasets, trio.CapacityLimiter(2))
    ds = ns.lookup(ROOT_INODE, b"ds")
    full = list(ns.readdir(ds, 0))
    assert [name for name, _, _ in full] == sorted([b"a.bin", b"empty", b"link", b"sub"])
    for i, (_, _, next_off) in enumerate(full):
        assert list(ns.readdir(ds, next_off)) == full[i + 1 :]
    assert [n for n, _, _ in ns.readdir(ROOT_INODE, 0)] == [b"ds", b"other"]
    for parent in (ROOT_INODE, ds, ns.lookup(ds, b"sub")):
        for name, attr, _ in ns.readdir(parent, 0):  # readdirplus attrs == lookup + getattr
            assert attr == ns.getattr(ns.lookup(parent, name))


async def test_statfs_reports_dataset_bytes(store):
    ops = make_ops(store)
    s = await ops.statfs(None)
    total = sum(len(v) for v in FILES.values()) + len(FILES[b"sub/big.bin"]) + 8
    assert s.f_blocks * s.f_frsize >= total
    assert s.f_bfree == 0


@pytest.mark.parametrize("damage", ["missing", "bad_header"])
async def test_unusable_chunk_file_reads_eio(store, damage, caplog):
    d = store.open("ds")
    ext = d.directory.first_extent(d.directory.resolve(b"a.bin"))
    path = d.chunk_path(d.directory.ext_chunk_view[ext])
    if damage == "missing":
        path.unlink()
    else:
        with open(path, "r+b") as f:
            f.write(b"NOTDLFS!")
    ops = make_ops(store)
    ino = await resolve(ops, b"ds/a.bin")
    for _ in range(2):
        with pytest.raises(pyfuse3.FUSEError) as info:
            await ops.read(ino, 0, 100)
        assert info.value.errno == errno.EIO
    logged = [r for r in caplog.records if "cannot use chunk" in r.getMessage()]
    assert len(logged) == 1


def test_in_place_check_copies_out_where_chunk_files_cannot_be_mapped(tmp_path, monkeypatch):
    """A chunk file system without shared mmap (ENODEV) still checks large extents."""
    data = os.urandom(3 << 20)
    path = tmp_path / "chunk"
    path.write_bytes(bytes(CHUNK_HEADER_SIZE) + data)
    fd = os.open(path, os.O_RDONLY)
    try:
        def refuse(*args, **kwargs):
            raise OSError(errno.ENODEV, "No such device")

        monkeypatch.setattr(reader_module.mmap, "mmap", refuse)
        assert reader_module._map_and_hash(fd, len(data), CHUNK_HEADER_SIZE)[1] == checksum(data)
    finally:
        os.close(fd)


def test_pages_a_chunk_file_cannot_deliver_read_as_eio(tmp_path, monkeypatch):
    """MADV_POPULATE_READ reports a page the file system failed to read (an I/O error) as
    EFAULT; the read must answer EIO, as a failed pread does, not EFAULT."""
    path = tmp_path / "chunk"
    path.write_bytes(bytes(CHUNK_HEADER_SIZE + (2 << 20)))
    real_mmap = reader_module.mmap.mmap

    class Failing:
        def __init__(self, *args, **kwargs):
            self._mapped = real_mmap(*args, **kwargs)

        def madvise(self, *args):
            raise OSError(errno.EFAULT, "Bad address")

        def close(self):
            self._mapped.close()

    monkeypatch.setattr(reader_module.mmap, "mmap", Failing)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            reader_module._map_and_hash(fd, 2 << 20, CHUNK_HEADER_SIZE)
        assert info.value.errno == errno.EIO
    finally:
        os.close(fd)

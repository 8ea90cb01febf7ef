"""The read-only file system's core (Namespace + reader) driven directly: no kernel, a
real store and reader; where the errno boundary matters, through the FUSE adapter
in this process (tests/wirefake.py)."""

from __future__ import annotations

import errno
import os
import random
import stat

import pytest
from wirefake import WireSide

import dlfsd.core.reader as reader_module
from dlfs.store.format import CHUNK_HEADER_SIZE, checksum
from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Store
from dlfsd.core.namespace import FIRST_DATASET_INODE, ROOT_INODE, Namespace
from dlfsd.fuse.errnomap import errno_for

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


@pytest.fixture
def make_ns(store):
    made = []

    def make(verify: bool = True, namespace_cls=Namespace) -> Namespace:
        made.append(namespace_cls([store.open(n) for n in store.dataset_names()], verify))
        return made[-1]

    yield make
    for ns in made:
        ns.close()


def resolve(ns: Namespace, path: bytes) -> int:
    ino = ROOT_INODE
    for part in path.split(b"/"):
        ino = ns.lookup(ino, part)
    return ino


def read_all(ns: Namespace, ino: int, size: int, step: int) -> bytes:
    ns.check_open(ino, os.O_RDONLY)
    fh, _ = ns.open(ino)
    out = b"".join([bytes(ns.read(fh, off, step)) for off in range(0, size + 1, step)])
    ns.release(fh)
    return out


def errno_of(call) -> int:
    """The errno a request answers with when the core raises in `call` (0: no error)."""
    try:
        call()
    except Exception as err:
        return errno_for(err, "test")
    return 0


def test_every_file_reads_back_exactly(make_ns):
    ns = make_ns()
    for rel, data in FILES.items():
        ino = resolve(ns, b"ds/" + rel)
        for step in (1000, 4096, 65536):
            assert read_all(ns, ino, len(data), step) == data


def test_reads_at_odd_offsets_and_past_eof(make_ns):
    ns = make_ns()
    data = FILES[b"sub/big.bin"]
    ino = resolve(ns, b"ds/sub/big.bin")
    for off, size in [(4090, 20), (8191, 2), (0, 1 << 20), (len(data) - 1, 10), (len(data), 10)]:
        assert bytes(ns.read(ino, off, size)) == data[off : off + size]


def test_attributes(make_ns):
    ns = make_ns()
    root = ns.getattr(ROOT_INODE)
    assert stat.S_ISDIR(root.mode) and root.nlink == 4
    ds = ns.lookup(ROOT_INODE, b"ds")
    assert ds == FIRST_DATASET_INODE  # datasets are laid out by name: ds, other
    f = ns.getattr(resolve(ns, b"ds/a.bin"))
    assert (f.size, stat.S_ISREG(f.mode)) == (5000, True)
    link = resolve(ns, b"ds/link")
    assert stat.S_ISLNK(ns.getattr(link).mode)
    assert ns.readlink(link) == b"a.bin"


@pytest.mark.parametrize("call, code", [
    (lambda ns: ns.lookup(ROOT_INODE, b"nope"), errno.ENOENT),
    (lambda ns: ns.getattr(10**9), errno.ENOENT),
    (lambda ns: ns.getattr(7), errno.ENOENT),  # reserved control range
    (lambda ns: ns.open(ROOT_INODE), errno.EISDIR),
    (lambda ns: ns.check_dir(FIRST_DATASET_INODE + 1), errno.ENOTDIR),
    (lambda ns: ns.check_open(FIRST_DATASET_INODE + 1, os.O_WRONLY), errno.EROFS),
    (lambda ns: ns.check_open(FIRST_DATASET_INODE + 1, os.O_RDWR | os.O_TRUNC), errno.EROFS),
    (lambda ns: ns.refuse_change("write"), errno.EROFS),
    (lambda ns: ns.refuse_change("mkdir"), errno.EROFS),
    (lambda ns: ns.readlink(FIRST_DATASET_INODE + 1), errno.ENOENT),
])
def test_errno_mapping(make_ns, call, code):
    ns = make_ns()
    assert errno_of(lambda: call(ns)) == code


def test_lookup_through_a_file_is_enotdir(make_ns):
    ns = make_ns()
    ino = resolve(ns, b"ds/a.bin")
    assert errno_of(lambda: ns.lookup(ino, b"x")) == errno.ENOTDIR


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


async def test_corrupt_extent_reads_eio_and_others_survive(store, make_ns, caplog):
    _flip_first_byte(store, b"a.bin")
    ns = make_ns()
    bad = resolve(ns, b"ds/a.bin")
    for _ in range(2):  # a read anywhere in the extent checks all of it
        assert errno_of(lambda: ns.read(bad, 100, 10)) == errno.EIO
    mismatches = [r for r in caplog.records if "checksum mismatch" in r.getMessage()]
    assert len(mismatches) == 1 and "a.bin" in mismatches[0].getMessage()
    good = resolve(ns, b"ds/sub/big.bin")
    assert read_all(ns, good, len(FILES[b"sub/big.bin"]), 4096) == FILES[b"sub/big.bin"]


def test_first_reads_in_any_order_check_each_extent_and_return_the_file(make_ns):
    """Pieces of a file read in shuffled order (what read-ahead spread over workers
    looks like to one of them): each first touch of an extent checks it whole, later
    pieces come from the checked copy; together they are the file."""
    ns = make_ns()
    ino = resolve(ns, b"ds/sub/big.bin")
    data = FILES[b"sub/big.bin"]
    offsets = list(range(0, len(data), 1000))
    random.Random(7).shuffle(offsets)
    results = {off: bytes(ns.read(ino, off, 1000)) for off in offsets}
    assert b"".join(results[o] for o in sorted(results)) == data


def test_unexpected_exception_becomes_eio_and_is_logged(make_ns, monkeypatch, caplog):
    class Broken(Namespace):
        def read_inode(self, ino, offset, size, caller):
            raise RuntimeError("boom")

    wire = WireSide(make_ns(namespace_cls=Broken), monkeypatch)
    try:
        assert wire.read(FIRST_DATASET_INODE + 1, 0, 0, 10)[0] == errno.EIO
    finally:
        wire.close()
    logged = [r for r in caplog.records if r.levelname == "ERROR" and r.exc_info]
    assert len(logged) == 1 and isinstance(logged[0].exc_info[1], RuntimeError)


def test_readdir_offsets_are_stable(make_ns):
    ns = make_ns()
    ds = ns.lookup(ROOT_INODE, b"ds")
    full = list(ns.readdir(ds, 0))
    assert [name for name, _, _ in full] == sorted([b"a.bin", b"empty", b"link", b"sub"])
    for i, (_, _, next_off) in enumerate(full):
        assert list(ns.readdir(ds, next_off)) == full[i + 1 :]
    assert [n for n, _, _ in ns.readdir(ROOT_INODE, 0)] == [b"ds", b"other"]
    for parent in (ROOT_INODE, ds, ns.lookup(ds, b"sub")):
        for name, attr, _ in ns.readdir(parent, 0):  # readdirplus attrs == lookup + getattr
            assert attr == ns.getattr(ns.lookup(parent, name))


def test_statfs_reports_dataset_bytes(make_ns):
    s = make_ns().statfs()
    total = sum(len(v) for v in FILES.values()) + len(FILES[b"sub/big.bin"]) + 8
    assert s.blocks * s.frsize >= total
    assert s.bfree == 0


@pytest.mark.parametrize("damage", ["missing", "bad_header"])
def test_unusable_chunk_file_reads_eio(store, make_ns, damage, caplog):
    d = store.open("ds")
    ext = d.directory.first_extent(d.directory.resolve(b"a.bin"))
    path = d.chunk_path(d.directory.ext_chunk_view[ext])
    if damage == "missing":
        path.unlink()
    else:
        with open(path, "r+b") as f:
            f.write(b"NOTDLFS!")
    ns = make_ns()
    ino = resolve(ns, b"ds/a.bin")
    for _ in range(2):
        assert errno_of(lambda: ns.read(ino, 0, 100)) == errno.EIO
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

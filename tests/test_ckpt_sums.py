"""Checksummed restart reads (docs/CKPT.md, "Checked reads from the store"), on real
mounts: the drain writes one xxh3-64 per 4 MiB extent of each copy it publishes to
`DIR/.dlfs-sums/<ino>-<size>-<mtime_ns>`; a node reading a placeholder (another
node's checkpoint) checks each extent on its first read, and the copy-back before a
write checks them too. A copy damaged on the store in place is EIO for the reads of
its bad extent only, and a write-open of it fails leaving it alone; a file without
sums (put there by hand, or replaced since) reads unchecked. Two mounts with their
own --cache-dir and one --ckpt-store are two nodes.
"""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest
import xxhash
from test_ckpt_restart import flush, local_tree, node, read, replace_on_store, wait_for

pytestmark = pytest.mark.usefixtures("daemon_guard")

EXTENT = 4 << 20
SUMS = b".dlfs-sums"
HEADER = struct.Struct("<8sIIQ")


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("sums-src")
    (src / "f").write_bytes(b"sample")
    return store_with(src, "ds", "64K")


def identity(path) -> str:
    st = os.lstat(path)
    return f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"


def sums_names(store: Path) -> set[str]:
    top = store / ".dlfs-sums"
    return set(os.listdir(top)) if top.exists() else set()


def store_files(store: Path) -> set[str]:
    """Identities of the regular files on the store, the sums directory aside."""
    found = set()
    for directory, dirs, files in os.walk(store):
        dirs[:] = [d for d in dirs if not (Path(directory) == store and d == ".dlfs-sums")]
        for name in files:
            found.add(identity(os.path.join(directory, name)))
    return found


def corrupt_in_place(path: Path, offset: int) -> None:
    """Flip one byte, keeping the inode, size and times: what a bad disk or cache
    does, invisible to stat."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        st.st_ino, st.st_size, st.st_mtime_ns)


def test_sums_are_written_at_drain_and_a_copy_damaged_on_the_store_is_eio_where_bad(
        mounted, small_store, tmp_path):
    store = tmp_path / "ckstore"
    a = node(mounted, small_store, tmp_path, "a")
    data = os.urandom(9 * (1 << 20) + 12345)  # three extents, the last partial
    (a.path / "ckpt" / "step-1").mkdir()
    (a.path / "ckpt" / "step-1" / "model.pt").write_bytes(data)
    flush(a)

    # The sums: named by the store copy's identity; one xxh3-64 per extent
    copy = store / "step-1" / "model.pt"
    assert sums_names(store) == {identity(copy)}
    raw = (store / ".dlfs-sums" / identity(copy)).read_bytes()
    magic, version, extent, size = HEADER.unpack_from(raw)
    assert (version, extent, size) == (1, EXTENT, len(data)), magic
    digests = struct.unpack_from("<3Q", raw, HEADER.size)
    assert len(raw) == HEADER.size + 3 * 8
    assert list(digests) == [xxhash.xxh3_64_intdigest(data[i:i + EXTENT])
                             for i in range(0, len(data), EXTENT)]

    # Node B reads it byte-exact from the store, checked; .dlfs-sums is never shown
    b = node(mounted, small_store, tmp_path, "b")
    assert read(b.path / "ckpt" / "step-1" / "model.pt") == data
    assert os.stat(os.path.join(local_tree(tmp_path, "b"), b"step-1", b"model.pt")
                   ).st_blocks == 0  # read from the store: the local copy is a hole
    # Each extent checked once for all of B's workers: their shared state says so
    checked = Path(os.fsdecode(local_tree(tmp_path, "b"))).parent / "checked"
    assert (checked / identity(copy)).read_bytes() == b"\x02" * 3
    for m in (a, b):
        assert sorted(os.listdir(m.path / "ckpt")) == ["step-1"]
        assert not os.path.exists(m.path / "ckpt" / ".dlfs-sums")
    with pytest.raises(OSError) as err:  # a reserved name, as the drain's temporaries
        (b.path / "ckpt" / ".dlfs-sums").mkdir()
    assert err.value.errno == errno.EINVAL

    # One byte of the second extent goes bad on the store, unseen by stat
    bad_at = EXTENT + 1000
    corrupt_in_place(copy, bad_at)
    damaged = copy.read_bytes()
    c = node(mounted, small_store, tmp_path, "c")
    path = c.path / "ckpt" / "step-1" / "model.pt"
    assert os.stat(path).st_size == len(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 65536, 0) == data[:65536]
        assert os.pread(fd, EXTENT, 0) == data[:EXTENT]  # the extent before: fine
        for offset in (EXTENT, bad_at, 2 * EXTENT - 4096):
            with pytest.raises(OSError) as err:
                os.pread(fd, 4096, offset)
            assert err.value.errno == errno.EIO, offset
        assert os.pread(fd, 65536, 2 * EXTENT) == data[2 * EXTENT:2 * EXTENT + 65536]
        assert os.pread(fd, 2 << 20, 8 << 20) == data[8 << 20:]  # the extent after: fine
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        read(path)
    assert err.value.errno == errno.EIO
    assert wait_for(lambda: "step-1/model.pt" in c.log_text()
                    and "extent 1" in c.log_text()), c.log_text()[-2000:]

    # A write-open copies the store's bytes back first: checked too, so it fails,
    # and the placeholder and the store's copy stay as they were
    with pytest.raises(OSError) as err:
        open(path, "r+b").close()
    assert err.value.errno == errno.EIO
    assert copy.read_bytes() == damaged
    local = os.path.join(local_tree(tmp_path, "c"), b"step-1", b"model.pt")
    assert os.stat(local).st_size == len(data)
    assert os.stat(local).st_blocks == 0
    assert os.stat(local).st_mtime_ns == os.stat(copy).st_mtime_ns
    with pytest.raises(OSError) as err:
        os.truncate(path, 10)  # a truncate copies back first too
    assert err.value.errno == errno.EIO
    flush(c)  # nothing of C's goes to the store
    assert copy.read_bytes() == damaged
    with open(path, "rb") as f:  # still the store's copy, still checked
        assert f.read(4096) == data[:4096]

    # Node B, whose workers checked the good copy before, keeps reading what they
    # checked; an O_TRUNC open copies nothing back: a new version, drained
    with open(b.path / "ckpt" / "step-1" / "model.pt", "wb") as f:
        f.write(b"rewritten")
    flush(b)
    assert (store / "step-1" / "model.pt").read_bytes() == b"rewritten"
    assert sums_names(store) == store_files(store)  # the damaged copy's sums went


def test_files_without_sums_read_unchecked(mounted, small_store, tmp_path):
    store = tmp_path / "ckstore"
    store.mkdir()
    by_hand = os.urandom(5 * (1 << 20) + 7)
    (store / "by-hand.pt").write_bytes(by_hand)  # no sums: put there by hand
    a = node(mounted, small_store, tmp_path, "a")
    drained = os.urandom(6 << 20)
    (a.path / "ckpt" / "drained.pt").write_bytes(drained)
    flush(a)
    assert sums_names(store) == {identity(store / "drained.pt")}
    # Replaced by hand since (a new inode): its sums name another copy, none fits
    replaced = os.urandom(len(drained))
    replace_on_store(store / "drained.pt", replaced)
    b = node(mounted, small_store, tmp_path, "b")
    assert read(b.path / "ckpt" / "by-hand.pt") == by_hand
    assert read(b.path / "ckpt" / "drained.pt") == replaced
    with open(b.path / "ckpt" / "by-hand.pt", "r+b") as f:  # copied back unchecked
        f.seek(5)
        f.write(b"x")
    flush(b)
    assert (store / "by-hand.pt").read_bytes() == by_hand[:5] + b"x" + by_hand[6:]
    assert identity(store / "by-hand.pt") in sums_names(store)  # B's drain wrote its sums


def test_sums_follow_the_store_copies_through_rewrite_rename_unlink_and_rmdir(
        mounted, small_store, tmp_path):
    store = tmp_path / "ckstore"
    a = node(mounted, small_store, tmp_path, "a")
    ck = a.path / "ckpt"
    (ck / "step-1").mkdir()
    for name in ("a.pt", "b.pt", "c.pt"):
        (ck / "step-1" / name).write_bytes(os.urandom(100_000))
    (ck / "empty.pt").write_bytes(b"")
    flush(a)
    assert sums_names(store) == store_files(store)
    assert len(sums_names(store)) == 4
    empty = HEADER.unpack_from((store / ".dlfs-sums" / identity(store / "empty.pt"))
                               .read_bytes())
    assert empty[3] == 0

    (ck / "step-1" / "a.pt").write_bytes(os.urandom(200_000))  # rewritten: published over
    flush(a)
    os.rename(ck / "step-1" / "b.pt", ck / "step-1" / "c.pt")  # over a drained file
    (ck / "empty.pt").unlink()
    assert sums_names(store) == store_files(store)
    assert len(sums_names(store)) == 2

    # Another node reads, renames and removes: the same bookkeeping there
    b = node(mounted, small_store, tmp_path, "b")
    cb = b.path / "ckpt"
    assert sorted(os.listdir(cb)) == ["step-1"]
    assert read(cb / "step-1" / "c.pt") == read(ck / "step-1" / "c.pt")
    os.rename(cb / "step-1" / "c.pt", cb / "step-1" / "a.pt")
    assert sums_names(store) == store_files(store)
    assert len(sums_names(store)) == 1
    for name in os.listdir(cb / "step-1"):
        os.unlink(cb / "step-1" / name)
    os.rmdir(cb / "step-1")  # the sums directory is at the root only: no ENOTEMPTY
    assert not (store / "step-1").exists()
    assert sums_names(store) == set()
    assert wait_for(lambda: os.listdir(ck) == [])


def test_a_drain_that_cannot_write_sums_publishes_all_the_same(mounted, small_store,
                                                               tmp_path):
    store = tmp_path / "ckstore"
    store.mkdir()
    (store / ".dlfs-sums").write_bytes(b"not a directory")  # every sums write fails
    a = node(mounted, small_store, tmp_path, "a")
    data = os.urandom(5 << 20)
    for name in ("one.pt", "two.pt"):
        (a.path / "ckpt" / name).write_bytes(data)
    flush(a)
    assert (store / "one.pt").read_bytes() == data
    assert (store / "two.pt").read_bytes() == data
    log = a.log_text()
    assert log.count("checkpoint checksums cannot be written") == 1, log[-2000:]
    b = node(mounted, small_store, tmp_path, "b")
    assert sorted(os.listdir(b.path / "ckpt")) == ["one.pt", "two.pt"]
    assert read(b.path / "ckpt" / "one.pt") == data  # unchecked

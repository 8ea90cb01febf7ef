"""Restart on another node (docs/CKPT.md): `MOUNTPOINT/ckpt/` shows the union of the
node's local tree and the checkpoint store, on real mounts.

Two mounts with their own --cache-dir and one --ckpt-store are two nodes: what node A
writes and flushes is listed, stat-ed and read byte-exact on node B (a name B looked
up before A flushed too), B's overwrite, partial write, unlink, rmdir and rm -r reach
the store and A follows them; empty directories and symlinks are mirrored; drain
temporaries and special files on the store are never shown; names need not be UTF-8;
a checkpoint put in the store by hand is shown; a placeholder a crash left behind is
removed at the next mount, never drained over the store's bytes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from conftest import run_dlfs

pytestmark = pytest.mark.usefixtures("daemon_guard")

ODD = b"\xff\xfeshard"  # not UTF-8
KERNEL_CACHE = 1.0  # seconds the kernel keeps a checkpoint entry (CKPT_ATTR_TIMEOUT)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("restart-src")
    (src / "f").write_bytes(b"sample")
    return store_with(src, "ds", "64K")


def node(mounted, store: Path, tmp: Path, name: str, *extra: str):
    """A mount with its own node cache and the shared checkpoint store `tmp/ckstore`."""
    return mounted(store, "--cache-dir", str(tmp / f"cache-{name}"), "--ckpt-store",
                   str(tmp / "ckstore"), *extra)


def flush(mount) -> None:
    result = run_dlfs("flush", mount.path, timeout=120)
    assert result.returncode == 0, result.stderr


def status_of(mount) -> dict:
    result = run_dlfs("status", mount.path, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def local_tree(tmp: Path, name: str) -> bytes:
    return os.fsencode(next((tmp / f"cache-{name}" / "ckpt").glob("*/tree")))


def names_under(top: bytes) -> set[bytes]:
    found = set()
    for directory, dirs, files in os.walk(top):
        for name in dirs + files:
            found.add(os.path.relpath(os.path.join(directory, name), top))
    return found


def test_a_checkpoint_flushed_on_node_a_is_listed_stat_read_changed_and_removed_on_node_b(
        mounted, small_store, tmp_path):
    a = node(mounted, small_store, tmp_path, "a")
    b = node(mounted, small_store, tmp_path, "b")
    ca, cb = os.fsencode(a.path / "ckpt"), os.fsencode(b.path / "ckpt")
    store = os.fsencode(tmp_path / "ckstore")

    # B asks before A has written anything: misses
    assert not os.path.exists(os.path.join(cb, b"model.pt"))
    assert not os.path.exists(os.path.join(cb, b"step-1"))
    assert os.listdir(cb) == []

    model = os.urandom(3 * (1 << 20) + 5)
    shard = os.urandom(200_000)
    with open(os.path.join(ca, b"model.pt"), "wb") as f:
        f.write(model)
    os.makedirs(os.path.join(ca, b"step-1", ODD))
    with open(os.path.join(ca, b"step-1", ODD, b"r\xe90.bin"), "wb") as f:
        f.write(shard)
    with open(os.path.join(ca, b"step-1", b"meta"), "wb") as f:
        f.write(b"meta")
    os.mkdir(os.path.join(ca, b"empty"))
    os.symlink(b"step-1", os.path.join(ca, b"latest"))
    # mkdir and symlink are mirrored at once, before any flush
    assert os.path.isdir(os.path.join(store, b"empty"))
    assert os.readlink(os.path.join(store, b"latest")) == b"step-1"
    flush(a)

    # Shown on B at once: a miss is not cached, by the daemon or the kernel
    assert os.path.exists(os.path.join(cb, b"model.pt"))
    assert sorted(os.listdir(cb)) == [b"empty", b"latest", b"model.pt", b"step-1"]
    assert sorted(os.listdir(os.path.join(cb, b"step-1"))) == [b"meta", ODD]
    for rel in (b"model.pt", os.path.join(b"step-1", ODD, b"r\xe90.bin"),
                os.path.join(b"step-1", b"meta")):
        sa, sb = os.stat(os.path.join(ca, rel)), os.stat(os.path.join(cb, rel))
        assert (sb.st_size, sb.st_mtime_ns) == (sa.st_size, sa.st_mtime_ns), rel
        assert read(os.path.join(cb, rel)) == read(os.path.join(ca, rel)), rel
    assert read(os.path.join(cb, b"model.pt")) == model
    assert os.readlink(os.path.join(cb, b"latest")) == b"step-1"
    assert read(os.path.join(cb, b"latest", ODD, b"r\xe90.bin")) == shard
    assert os.listdir(os.path.join(cb, b"empty")) == []
    # B read them from the store: its local copies are holes
    tree_b = local_tree(tmp_path, "b")
    assert os.stat(os.path.join(tree_b, b"model.pt")).st_blocks == 0

    # The store's copies in progress and special files are never shown
    hidden = os.path.join(store, b".model.pt.dlfs-drain-otherhost-0a1b2c3d")
    with open(hidden, "wb") as f:
        f.write(b"half")
    os.mkfifo(os.path.join(store, b"fifo"))
    assert b".model.pt.dlfs-drain-otherhost-0a1b2c3d" not in os.listdir(cb)
    assert b"fifo" not in os.listdir(cb)
    assert not os.path.lexists(os.path.join(cb, b".model.pt.dlfs-drain-otherhost-0a1b2c3d"))
    os.unlink(hidden)
    os.unlink(os.path.join(store, b"fifo"))
    for reserved in (b".x.dlfs-drain-host-1", b".dlfs-adopt-1"):  # the tier's own names
        with pytest.raises(OSError) as err:
            open(os.path.join(cb, reserved), "wb").close()
        assert err.value.errno == errno.EINVAL

    # B overwrites the model and changes one byte of a shard: drained as B's versions
    new_model = os.urandom(1 << 20)
    with open(os.path.join(cb, b"model.pt"), "wb") as f:
        f.write(new_model)
    with open(os.path.join(cb, b"step-1", ODD, b"r\xe90.bin"), "r+b") as f:
        f.seek(1000)
        f.write(b"B")
    changed = shard[:1000] + b"B" + shard[1001:]
    assert read(os.path.join(cb, b"step-1", ODD, b"r\xe90.bin")) == changed
    flush(b)
    assert read(os.path.join(store, b"model.pt")) == new_model
    assert read(os.path.join(store, b"step-1", ODD, b"r\xe90.bin")) == changed
    # ... and A, whose copies were drained and unchanged since, follows the store once
    # its kernel's entry expires (KERNEL_CACHE)
    assert wait_for(lambda: read(os.path.join(ca, b"model.pt")) == new_model)
    assert os.stat(os.path.join(ca, b"model.pt")).st_size == len(new_model)
    assert wait_for(lambda: read(os.path.join(ca, b"step-1", ODD, b"r\xe90.bin")) == changed)

    # B removes: the store's copies go, and A's view follows
    os.unlink(os.path.join(cb, b"step-1", b"meta"))
    assert not os.path.exists(os.path.join(store, b"step-1", b"meta"))
    assert wait_for(lambda: not os.path.exists(os.path.join(ca, b"step-1", b"meta")))
    os.rmdir(os.path.join(cb, b"empty"))
    assert not os.path.exists(os.path.join(store, b"empty"))
    shutil.rmtree(os.path.join(cb, b"step-1"))
    assert not os.path.exists(os.path.join(store, b"step-1"))
    assert wait_for(lambda: sorted(os.listdir(ca)) == [b"latest", b"model.pt"])
    assert not any(b".dlfs-" in n for n in names_under(local_tree(tmp_path, "a")))
    # the store's checksums are those of its files (test_ckpt_sums), nothing else
    assert not any(b".dlfs-" in n for n in names_under(store)
                   if not n.startswith(b".dlfs-sums/") and n != b".dlfs-sums")
    st = os.lstat(os.path.join(store, b"model.pt"))
    assert os.listdir(os.path.join(store, b".dlfs-sums")) == [
        b"%d-%d-%d" % (st.st_ino, st.st_size, st.st_mtime_ns)]


def test_a_local_file_not_drained_yet_wins_here_and_is_kept_beside_the_store(
        mounted, small_store, tmp_path):
    """B's file, written and not drained, wins on B over A's newer copy; its drain
    then never replaces A's copy (B last saw another one: no rollback of the store),
    it is kept as x.dlfs-conflict-HOST-TIME and drained under that name."""
    a = node(mounted, small_store, tmp_path, "a")
    b = node(mounted, small_store, tmp_path, "b")
    (a.path / "ckpt" / "x").write_bytes(b"from A")
    flush(a)
    assert (b.path / "ckpt" / "x").read_bytes() == b"from A"  # adopted on B
    fd = os.open(b.path / "ckpt" / "x", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"B, not drained yet")
    stop = threading.Event()

    def keep_writing() -> None:  # an open file written within 2 s is not drained
        while not stop.wait(0.3):
            os.pwrite(fd, b"B", 0)

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:
        (a.path / "ckpt" / "x").write_bytes(b"A again")
        flush(a)
        assert (tmp_path / "ckstore" / "x").read_bytes() == b"A again"
        time.sleep(KERNEL_CACHE + 0.2)
        assert (b.path / "ckpt" / "x").read_bytes() == b"B, not drained yet"
    finally:
        stop.set()
        writer.join()
        os.close(fd)
    flush(b)
    store = tmp_path / "ckstore"
    assert (store / "x").read_bytes() == b"A again"
    kept = [p for p in store.iterdir() if p.name.startswith("x.dlfs-conflict-")]
    assert [p.read_bytes() for p in kept] == [b"B, not drained yet"]
    assert wait_for(lambda: status_of(b)["ckpt"]["conflicts"] == 1)  # rewritten each second
    assert status_of(b)["ckpt"]["conflict_names"] == [kept[0].name]
    time.sleep(KERNEL_CACHE + 0.2)
    assert (b.path / "ckpt" / "x").read_bytes() == b"A again"  # B follows the store again


def test_a_file_open_for_writing_is_never_replaced_by_another_nodes_copy(
        mounted, small_store, tmp_path):
    """Even once drained (it was idle) and no longer pending: through passthrough the
    daemon sees none of its writes, the open-files table says it is being written. A
    replaced file would leave the writer writing an unlinked inode, never drained."""
    a = node(mounted, small_store, tmp_path, "a")
    b = node(mounted, small_store, tmp_path, "b")
    stored = tmp_path / "ckstore" / "y"
    fd = os.open(b.path / "ckpt" / "y", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"B, kept open")
        assert wait_for(lambda: stored.exists() and stored.read_bytes() == b"B, kept open",
                        30)  # drained once idle (2 s), still open
        assert (a.path / "ckpt" / "y").read_bytes() == b"B, kept open"  # adopted on A
        (a.path / "ckpt" / "y").write_bytes(b"A, newer")
        flush(a)
        assert stored.read_bytes() == b"A, newer"
        time.sleep(KERNEL_CACHE + 0.2)
        assert (b.path / "ckpt" / "y").read_bytes() == b"B, kept open"
        os.pwrite(fd, b"b", 0)
    finally:
        os.close(fd)
    flush(b)
    assert stored.read_bytes() == b"A, newer"  # B's drain never rolls the store back
    kept = [p for p in stored.parent.iterdir() if p.name.startswith("y.dlfs-conflict-")]
    assert [p.read_bytes() for p in kept] == [b"b, kept open"]  # nor is B's lost


def test_a_checkpoint_put_in_the_store_by_hand_is_shown_and_rmdir_sees_its_entries(
        mounted, small_store, tmp_path):
    store = os.fsencode(tmp_path / "ckstore")
    os.makedirs(os.path.join(store, b"step-7", ODD))
    with open(os.path.join(store, b"step-7", ODD, b"\xe9.bin"), "wb") as f:
        f.write(b"by hand" * 1000)
    os.symlink(b"step-7", os.path.join(store, b"latest"))
    m = node(mounted, small_store, tmp_path, "a")
    ck = os.fsencode(m.path / "ckpt")
    assert read(os.path.join(ck, b"latest", ODD, b"\xe9.bin")) == b"by hand" * 1000
    assert os.path.islink(os.path.join(ck, b"latest"))
    # step-7 is known here, its entries were never listed: not empty in ckpt/ either
    with pytest.raises(OSError) as err:
        os.rmdir(os.path.join(ck, b"step-7"))
    assert err.value.errno == errno.ENOTEMPTY
    assert os.path.isdir(os.path.join(store, b"step-7", ODD))

    # a rename mirrors on the store; a directory made on the store meanwhile shows
    os.rename(os.path.join(ck, b"step-7"), os.path.join(ck, b"step-8"))
    assert os.listdir(os.path.join(store, b"step-8")) == [ODD]
    os.mkdir(os.path.join(store, b"step-9"))
    assert os.path.isdir(os.path.join(ck, b"step-9"))
    os.rmdir(os.path.join(store, b"step-9"))
    assert b"step-9" not in os.listdir(ck)  # an adopted directory follows the store


def test_a_placeholder_a_crash_left_is_removed_at_the_next_mount_not_drained(
        mounted, small_store, tmp_path):
    m = node(mounted, small_store, tmp_path, "a")
    (m.path / "ckpt" / "real").write_bytes(b"real")
    flush(m)
    assert run_dlfs("umount", m.path).returncode == 0
    tree = local_tree(tmp_path, "a")
    # as a daemon killed between making a placeholder and recording it leaves it
    with open(os.path.join(tree, b".model.pt.dlfs-adopt-0a1b2c3d"), "wb") as f:
        f.truncate(1 << 20)
    again = node(mounted, small_store, tmp_path, "a")
    assert os.listdir(again.path / "ckpt") == ["real"]
    flush(again)
    assert sorted(os.listdir(tmp_path / "ckstore")) == [".dlfs-sums", "real"]
    assert not os.path.exists(os.path.join(tree, b".model.pt.dlfs-adopt-0a1b2c3d"))


def replace_on_store(path: Path, data: bytes) -> None:
    """As another node's drain does: a new file renamed over the old one."""
    tmp = path.with_name(f".{path.name}.dlfs-drain-otherhost-00000000")
    tmp.write_bytes(data)
    os.rename(tmp, path)


def test_a_copy_replaced_on_the_store_is_opened_new_at_once_and_never_read_mixed(
        mounted, small_store, tmp_path):
    store = tmp_path / "ckstore"
    store.mkdir()
    old = os.urandom(1 << 20)
    (store / "adopted").write_bytes(old)
    m = node(mounted, small_store, tmp_path, "a")
    ck = m.path / "ckpt"
    (ck / "drained").write_bytes(old)
    flush(m)

    # An open right after the kernel checked the entry (within its 1 s) still gets the
    # store's new version, with its own size: the stale open is answered ESTALE and the
    # kernel looks the path up again.
    for name in ("adopted", "drained"):
        assert (ck / name).read_bytes() == old
        new = os.urandom(300_000)
        os.stat(ck / name)
        replace_on_store(store / name, new)
        assert (ck / name).read_bytes() == new, name
        assert os.stat(ck / name).st_size == len(new)

    # A file open while its store copy is replaced reads the version it opened, or
    # fails (ESTALE), never the new one's bytes.
    (store / "open").write_bytes(old)
    fd = os.open(ck / "open", os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == old[:4096]
        replace_on_store(store / "open", os.urandom(len(old)))
        os.stat(ck / "open")  # a lookup elsewhere notices the new version
        time.sleep(KERNEL_CACHE + 0.2)
        os.stat(ck / "open")
        for offset in range(0, len(old), 64 << 10):
            try:
                got = os.pread(fd, 64 << 10, offset)
            except OSError as err:
                assert err.errno in (errno.ESTALE, errno.ENOENT), err
                continue
            assert got == old[offset:offset + (64 << 10)], offset
    finally:
        os.close(fd)

"""The checkpoint tier's core without a mount: path resolution (dlfsd.ckpt.beneath), the
user's credentials (dlfsd.ckpt.creds), and the tree, union and drain in one process
(two nodes' tiers sharing one store), as fast unit tests of what the FUSE tests show
end to end.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

import dlfsd.ckpt.beneath as beneath
from dlfsd.ckpt.beneath import Beneath
from dlfsd.ckpt.creds import Creds
from dlfsd.ckpt.drain import Drainer
from dlfsd.ckpt.tier import Tier
from dlfsd.ckpt.tree import CkptTree

NOBODY = 65534  # a uid no file here belongs to


@pytest.fixture(params=["openat2", "component by component"])
def resolution(request, monkeypatch):
    """Both ways of resolving beneath a root: the kernel's openat2, and the fallback of
    kernels before 5.6 and of seccomp filters that refuse it."""
    monkeypatch.setattr(beneath, "_openat2_works", None if request.param == "openat2" else False)
    return request.param


def test_beneath_never_follows_a_link_nor_leaves_the_root(tmp_path, resolution):
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"inside")
    (tmp_path / "outside").write_bytes(b"outside")
    (root / "link").symlink_to(tmp_path)
    (root / "flink").symlink_to(tmp_path / "outside")
    tree = Beneath(root, Creds.none())
    assert tree.lstat(b"d/f").st_size == 6
    for rel, code in [(b"link/outside", errno.ELOOP), (b"../outside", errno.EINVAL),
                      (os.fsencode(tmp_path / "outside"), errno.EINVAL),
                      (b"d/./f", errno.EINVAL), (b"d//f", errno.EINVAL)]:
        with pytest.raises(OSError) as err:
            tree.lstat(rel)
        assert err.value.errno in (code, errno.ENOTDIR), rel
    with pytest.raises(OSError) as err:
        tree.open(b"flink", os.O_RDONLY)  # the last component is not followed either
    assert err.value.errno == errno.ELOOP
    with pytest.raises(OSError):
        tree.chmod(b"flink", 0o777)
    assert tree.readlink(b"flink") == os.fsencode(tmp_path / "outside")
    top, entries = tree.walk()[0]
    assert top == b"" and {name for name, _ in entries} == {b"d", b"link", b"flink"}
    assert [d for d, _ in tree.walk()] == [b"", b"d"]  # never into `link`


@pytest.mark.skipif(os.geteuid() != 0, reason="switching credentials needs root")
def test_creds_hold_for_the_block_and_the_thread_only(tmp_path):
    mine = tmp_path / "users"
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    secret = tmp_path / "root-only"
    secret.write_bytes(b"s")
    secret.chmod(0o600)
    creds = Creds(NOBODY, NOBODY)
    other_thread_could_read = []
    inside = threading.Event()
    done = threading.Event()

    def root_thread() -> None:
        inside.wait(10)
        try:
            other_thread_could_read.append(secret.read_bytes() == b"s")
        finally:
            done.set()

    helper = threading.Thread(target=root_thread)
    helper.start()
    dirfd = os.open(mine, os.O_PATH | os.O_DIRECTORY)  # pytest's tmp is 0700: as the tier,
    try:  # the user works below a descriptor root opened
        with creds:
            fd = os.open("made", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=dirfd)
            os.close(fd)
    finally:
        os.close(dirfd)
    with creds:
        with pytest.raises(PermissionError):
            secret.read_bytes()
        inside.set()
        done.wait(10)  # another thread of this process stays root meanwhile
    helper.join()
    assert other_thread_could_read == [True]
    assert os.stat(mine / "made").st_uid == NOBODY
    assert secret.read_bytes() == b"s"  # root again after the block


def drain_all(tier: Tier) -> None:
    drainer = Drainer(tier, idle=0.0)
    drainer.start()
    try:
        deadline = time.monotonic() + 20
        while tier.state.pending_rows() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not tier.state.pending_rows(), tier.state.pending_rows()
    finally:
        drainer.stop()


def write(tree: CkptTree, name: bytes, data: bytes) -> int:
    attr = tree.create(tree.root_nodeid, name, os.O_TRUNC, 0o644)
    tree.write(attr.ino, 0, data)
    tree.release(attr.ino)
    tree.closed(attr.ino & ~(1 << 63), written=True)
    return attr.ino


def test_two_nodes_in_one_process_adopt_and_never_roll_back(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    a = Tier(str(tmp_path / "cache-a"), str(store))
    b = Tier(str(tmp_path / "cache-b"), str(store))
    try:
        tree_a, tree_b = CkptTree(a), CkptTree(b)
        write(tree_a, b"x", b"v1")
        drain_all(a)
        seen_b = tree_b.lookup(tree_b.root_nodeid, b"x")  # adopted: a placeholder
        assert tree_b.read(seen_b.ino, 0, 10) == b"v1"
        tree_b.open(seen_b.ino, os.O_WRONLY | os.O_TRUNC)
        tree_b.write(seen_b.ino, 0, b"B's")  # B's version, not drained yet
        write(tree_a, b"x", b"v3")  # A replaces x meanwhile
        drain_all(a)
        tree_b.release(seen_b.ino)
        tree_b.closed(seen_b.ino & ~(1 << 63), written=True)
        drain_all(b)
        assert (store / "x").read_bytes() == b"v3"
        (kept,) = [p for p in store.iterdir() if p.name.startswith("x.dlfs-conflict-")]
        assert kept.read_bytes() == b"B's"
    finally:
        a.close()
        b.close()

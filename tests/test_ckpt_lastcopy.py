"""No rollback and no lost last copy (issue 29, item 3 and the daemon's part of 4).

A job requeued onto a node that still holds an older, undrained copy must not roll
the store back; an eviction must never drop the local copy while the store's is gone
or damaged; a daemon whose checkpoint connection is aborted drains what it holds
before it exits (the epilog's flush cannot reach it any more).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import kill_and_reap, run_dlfs, wait_dead
from test_ckpt_restart import flush, node, wait_for
from test_lifecycle import _abort_fuse_connection


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("lastcopy-src")
    (src / "f").write_bytes(b"sample")
    return store_with(src, "ds", "64K")


def drain_temporaries(store: Path) -> list[str]:
    return [n for n in os.listdir(store) if ".dlfs-drain-" in n]


def local_blocks(tmp: Path, name: str, rel: str) -> int:
    (tier,) = (tmp / f"cache-{name}" / "ckpt").iterdir()
    return os.stat(tier / "tree" / rel).st_blocks


def test_a_requeued_jobs_stale_copy_never_rolls_the_store_back(mounted, small_store,
                                                                tmp_path):
    """Node A is killed while draining v2 of x; the job runs on B, which reads v1 and
    writes v3; back on A, the resumed drain finds the store's x is not the copy A last
    saw: v3 stays, A's v2 is kept beside it under a conflict name."""
    store = tmp_path / "ckstore"
    a = node(mounted, small_store, tmp_path, "a", "--drain-bandwidth", "1M",
             "--drain-jobs", "1")
    (a.path / "ckpt" / "x").write_bytes(b"v1")
    flush(a)
    v2 = os.urandom(6 << 20)
    (a.path / "ckpt" / "x").write_bytes(v2)
    assert wait_for(lambda: drain_temporaries(store), 20), "the drain of v2 never started"
    kill_and_reap(a.pid)
    assert wait_dead(a.pid)
    run_dlfs("umount", a.path)  # the dead mount
    assert (store / "x").read_bytes() == b"v1"

    b = node(mounted, small_store, tmp_path, "b")
    assert (b.path / "ckpt" / "x").read_bytes() == b"v1"
    (b.path / "ckpt" / "x").write_bytes(b"v3")
    flush(b)
    assert (store / "x").read_bytes() == b"v3"

    again = node(mounted, small_store, tmp_path, "a")
    assert "still to drain" in again.log_text()
    flush(again)
    assert (store / "x").read_bytes() == b"v3", "the store was rolled back"
    kept = [p for p in store.iterdir() if p.name.startswith("x.dlfs-conflict-")]
    assert len(kept) == 1 and kept[0].read_bytes() == v2, "A's version was lost"
    assert "conflict" in again.log_text()


@pytest.mark.parametrize("harm", ["removed", "damaged"])
def test_eviction_keeps_the_local_copy_when_the_stores_is_gone_or_bad(
        mounted, small_store, tmp_path, harm):
    m = node(mounted, small_store, tmp_path, "a", "--ckpt-limit", "3M", "--ckpt-keep", "1")
    one, two = os.urandom(2 << 20), os.urandom(2 << 20)
    (m.path / "ckpt" / "step-1").mkdir()
    (m.path / "ckpt" / "step-1" / "model.bin").write_bytes(one)
    flush(m)
    stored = tmp_path / "ckstore" / "step-1" / "model.bin"
    if harm == "removed":
        stored.unlink()  # by hand, or another node's cleanup
    else:
        with open(stored, "r+b") as f:  # bit rot in place: same size, mtime put back
            st = os.fstat(f.fileno())
            f.seek(1 << 20)
            f.write(b"\xff" if one[1 << 20] != 0xFF else b"\x00")
        os.utime(stored, ns=(st.st_atime_ns, st.st_mtime_ns))
    time.sleep(0.05)
    (m.path / "ckpt" / "step-2").mkdir()
    (m.path / "ckpt" / "step-2" / "model.bin").write_bytes(two)  # over the limit now
    flush(m)
    time.sleep(3)  # the limit is enforced every second: evictions had their chances
    assert local_blocks(tmp_path, "a", "step-1/model.bin") > 0, \
        "the local copy was evicted though the store's is " + harm
    (tier,) = (tmp_path / "cache-a" / "ckpt").iterdir()
    assert (tier / "tree" / "step-1" / "model.bin").read_bytes() == one
    if harm == "damaged":  # still shown: the store's copy is the same file, not a new one
        assert (m.path / "ckpt" / "step-1" / "model.bin").read_bytes() == one


def test_an_aborted_checkpoint_connection_drains_before_the_daemon_exits(
        mounted, small_store, tmp_path):
    m = node(mounted, small_store, tmp_path, "a", "--drain-bandwidth", "2M")
    payload = os.urandom(3 << 20)
    (m.path / "ckpt" / "last.pt").write_bytes(payload)  # closed: ~1.5 s to drain
    ckpt_mount = m.path / "ckpt"
    _abort_fuse_connection(ckpt_mount if ckpt_mount.is_mount() else m.path)
    assert wait_dead(m.pid, timeout=60), "the daemon did not exit"
    assert (tmp_path / "ckstore" / "last.pt").read_bytes() == payload
    run_dlfs("umount", m.path)

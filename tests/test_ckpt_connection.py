"""MOUNTPOINT/ckpt as a FUSE connection of its own (dlfsd.fuse.rawsession), on real mounts.

- The datasets' connection keeps FUSE no_open with a checkpoint tier mounted: a
  dataset open never reaches the daemon (the trace shows reads, no opens).
- FUSE passthrough (root, Linux >= 6.9): checkpoint bytes go from the kernel to the
  local copy without WRITE requests; many opens of one file share its backing id;
  a file kept open is drained once idle; everything drains byte-identical. Without
  passthrough (DLFS_CKPT_PASSTHROUGH=0) every write() is WRITE requests.
- `dlfs umount` takes the checkpoint connection down first; when it is busy it says
  so in one line and leaves both mounts up.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import run_dlfs

from dlfs.mountinfo import CKPT_FSTYPE, find_mount

pytestmark = pytest.mark.usefixtures("daemon_guard")

MIB = 1 << 20


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("ckconn-src")
    (src / "a").mkdir()
    for i in range(4):
        (src / "a" / f"x{i}.bin").write_bytes(os.urandom(5000 + i))
    return store_with(src, "ds", "64K")


def ckpt_mount(mounted, store: Path, tmp: Path, *extra: str):
    return mounted(store, "--cache-dir", str(tmp / "cache"), "--ckpt-store",
                   str(tmp / "ckstore"), *extra)


def ckpt_status(mount) -> dict:
    result = run_dlfs("status", mount.path, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["ckpt"]


def status_once(mount, predicate, what: str) -> dict:
    """The checkpoint status once `predicate` holds (the file is rewritten every second)."""
    found: dict = {}

    def check() -> bool:
        found.update(ckpt_status(mount))
        return predicate(found)

    wait_for(check, 10, what)
    return found


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def write_mib(path: Path, count: int, seed: int) -> bytes:
    """`count` 1 MiB write() calls (unbuffered), what a checkpoint writer does."""
    data = hashlib.shake_256(str(seed).encode()).digest(count * MIB)
    with open(path, "wb", buffering=0) as f:
        for i in range(count):
            f.write(data[i * MIB:(i + 1) * MIB])
    return data


def test_the_ckpt_mount_is_its_own_and_dataset_opens_skip_the_daemon(mounted, small_store,
                                                                     tmp_path):
    m = ckpt_mount(mounted, small_store, tmp_path)
    entry = find_mount(os.path.realpath(m.path / "ckpt"))
    assert entry is not None and entry.fstype == CKPT_FSTYPE
    assert os.stat(m.path / "ckpt").st_dev != os.stat(m.path / "ds").st_dev
    assert run_dlfs("trace", "start", m.path).returncode == 0
    names = sorted(os.listdir(m.path / "ds" / "a"))
    for _ in range(3):  # opened and read three times: the kernel keeps the pages
        for name in names:
            (m.path / "ds" / "a" / name).read_bytes()
    (m.path / "ckpt" / "w").write_bytes(b"w")
    traced = run_dlfs("trace", "stop", m.path, "-o", tmp_path / "trace.csv")
    assert traced.returncode == 0, traced.stderr
    rows = [line.split(",") for line in (tmp_path / "trace.csv").read_text().splitlines()
            if line and not line.startswith(("#", "time_ns"))]
    dataset_ops = [(r[3], r[5]) for r in rows if r[4] == "ds"]
    assert {op for op, _ in dataset_ops} >= {"read"}, dataset_ops
    assert not [op for op, _ in dataset_ops if op in ("open", "release")], dataset_ops
    reads = Counter(path for op, path in dataset_ops if op == "read")
    assert sorted(reads) == [f"ds/a/{name}" for name in names]
    assert set(reads.values()) == {1}, reads  # then the page cache
    assert any(r[3] == "write" and r[4] == "ckpt" for r in rows)


def passthrough_mount(mounted, store: Path, tmp: Path, *extra: str):
    m = ckpt_mount(mounted, store, tmp, *extra)
    state = ckpt_status(m)["passthrough"]
    if state != "on":
        pytest.skip(f"FUSE passthrough is {state}")
    return m


def test_passthrough_writes_skip_the_daemon_share_one_backing_id_and_drain(
        mounted, small_store, tmp_path):
    m = passthrough_mount(mounted, small_store, tmp_path)
    ck = m.path / "ckpt"
    data = write_mib(ck / "model.pt", 8, seed=1)
    status = status_once(m, lambda s: s["written_bytes"] >= 8 * MIB, "the bytes written")
    assert status["written_bytes"] == 8 * MIB
    assert status["write_requests"] == 1  # counted once, at close: no WRITE reached us
    human = run_dlfs("status", m.path)
    assert human.returncode == 0 and "passthrough on;" in human.stdout, human.stdout
    assert (ck / "model.pt").read_bytes() == data

    # many opens of one file at once, reading and writing, reach several workers:
    # each must name the same backing id, or the kernel refuses the open (EBUSY)
    files = [open(ck / "model.pt", "rb" if i % 2 else "r+b") for i in range(12)]  # noqa: SIM115
    try:
        files[0].seek(MIB)
        files[0].write(b"\xff" * 4096)
        files[0].flush()
        for f in files[1::2]:
            f.seek(MIB)
            assert f.read(4096) == b"\xff" * 4096
        # one file, one backing id (status is rewritten every second)
        wait_for(lambda: ckpt_status(m)["passthrough_open"] == 1, 10, "the status")
    finally:
        for f in files:
            f.close()
    wait_for(lambda: ckpt_status(m)["passthrough_open"] == 0, 10, "the last release")
    expected = data[:MIB] + b"\xff" * 4096 + data[MIB + 4096:]
    assert run_dlfs("flush", m.path).returncode == 0
    assert (tmp_path / "ckstore" / "model.pt").read_bytes() == expected

    # a file kept open: drained once its writes stop for --ckpt-idle (2 s), and again
    # after it is written again; the daemon sees none of those writes
    f = open(ck / "open.bin", "wb", buffering=0)  # noqa: SIM115
    try:
        f.write(b"a" * MIB)
        stored = tmp_path / "ckstore" / "open.bin"
        wait_for(lambda: stored.exists() and stored.read_bytes() == b"a" * MIB, 30,
                 "the drain of an idle open file")
        f.write(b"b" * MIB)
        wait_for(lambda: stored.read_bytes() == b"a" * MIB + b"b" * MIB, 30,
                 "the second drain of the open file")
    finally:
        f.close()


def test_without_passthrough_every_write_is_a_request_and_drains_the_same(
        mounted, small_store, tmp_path, monkeypatch):
    monkeypatch.setenv("DLFS_CKPT_PASSTHROUGH", "0")  # `dlfs mount` hands it to the daemon
    m = ckpt_mount(mounted, small_store, tmp_path)
    status = ckpt_status(m)
    assert status["passthrough"] == "off (DLFS_CKPT_PASSTHROUGH=0)"
    human = run_dlfs("status", m.path)
    assert "passthrough off (DLFS_CKPT_PASSTHROUGH=0); 0 checkpoint files open" \
        in human.stdout, human.stdout
    assert status["passthrough_open"] is None
    # the drain's threads (2 copying, 1 scanning) run as background work: nice +10
    tasks = Path(f"/proc/{m.pid}/task")
    niced = [t for t in tasks.iterdir()
             if int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) == 10]
    assert len(niced) == 3, [t.name for t in niced]
    data = write_mib(m.path / "ckpt" / "model.pt", 8, seed=2)
    status = status_once(m, lambda s: s["written_bytes"] >= 8 * MIB, "the bytes written")
    assert status["written_bytes"] == 8 * MIB and status["write_requests"] >= 8
    assert run_dlfs("flush", m.path).returncode == 0
    assert (tmp_path / "ckstore" / "model.pt").read_bytes() == data


def test_umount_takes_ckpt_down_first_and_a_busy_ckpt_says_so(mounted, small_store,
                                                             tmp_path):
    m = ckpt_mount(mounted, small_store, tmp_path)
    real = os.path.realpath(m.path)
    (m.path / "ckpt" / "keep").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              cwd=m.path / "ckpt" / "keep")
    try:
        busy = run_dlfs("umount", m.path)
        assert busy.returncode != 0
        assert len(busy.stderr.strip().splitlines()) == 1 and "busy" in busy.stderr
        assert find_mount(real) is not None and find_mount(real + "/ckpt") is not None
    finally:
        holder.kill()
        holder.wait()
    done = run_dlfs("umount", m.path)
    assert done.returncode == 0, done.stderr
    assert find_mount(real) is None and find_mount(real + "/ckpt") is None
    for pid in m.pids:
        wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 10, f"daemon {pid}")


def local_blocks(tmp: Path, rel: str) -> int:
    tree = next((tmp / "cache" / "ckpt").glob("*/tree"))
    return os.stat(tree / rel).st_blocks


def test_an_open_checkpoint_file_is_never_evicted_and_goes_once_closed(
        mounted, small_store, tmp_path):
    m = ckpt_mount(mounted, small_store, tmp_path, "--ckpt-limit", "3M", "--ckpt-keep", "1")
    assert ckpt_status(m)["passthrough"].startswith("off (--ckpt-limit")
    one, two = os.urandom(2 * MIB), os.urandom(2 * MIB)
    (m.path / "ckpt" / "step-1").write_bytes(one)
    assert run_dlfs("flush", m.path).returncode == 0
    reader = open(m.path / "ckpt" / "step-1", "rb")  # noqa: SIM115 (held across the limit)
    try:
        status_once(m, lambda s: s["open_files"] == 1, "the open file in status")
        time.sleep(0.05)  # step-2 is the newer checkpoint
        (m.path / "ckpt" / "step-2").write_bytes(two)
        assert run_dlfs("flush", m.path).returncode == 0
        # over the limit's low water with step-1 the only candidate: it stays while
        # open (the drain checks every second), and reads its local copy
        time.sleep(3)
        assert local_blocks(tmp_path, "step-1") > 0
        assert reader.read() == one
    finally:
        reader.close()
    wait_for(lambda: local_blocks(tmp_path, "step-1") == 0, 20, "the eviction once closed")
    assert (m.path / "ckpt" / "step-1").read_bytes() == one  # now from the store's copy
    status_once(m, lambda s: s["open_files"] == 0, "no open file in status")


def test_a_file_opened_for_writing_and_closed_unchanged_is_not_copied_again(
        mounted, small_store, tmp_path):
    m = ckpt_mount(mounted, small_store, tmp_path)
    data = write_mib(m.path / "ckpt" / "model.pt", 2, seed=3)
    assert run_dlfs("flush", m.path).returncode == 0
    stored = tmp_path / "ckstore" / "model.pt"
    first = os.stat(stored).st_ino
    with open(m.path / "ckpt" / "model.pt", "r+b") as f:  # h5py's "r+": nothing written
        assert f.read(16) == data[:16]
    assert run_dlfs("flush", m.path).returncode == 0
    assert os.stat(stored).st_ino == first  # a new drain would have renamed a new copy in
    with open(m.path / "ckpt" / "model.pt", "r+b") as f:
        f.write(b"changed")
    assert run_dlfs("flush", m.path).returncode == 0
    assert os.stat(stored).st_ino != first
    assert stored.read_bytes() == b"changed" + data[7:]


def test_a_readers_close_leaves_a_file_being_written_alone_and_flush_waits_for_it(
        mounted, small_store, tmp_path):
    """RELEASE is asynchronous and says nothing of the other opens of the file: only
    the last close makes a file due for the drain at once. And a file drained while
    open (idle) and written since (through passthrough: unseen) is one `dlfs flush`
    waits for."""
    m = ckpt_mount(mounted, small_store, tmp_path)
    ck, stored = m.path / "ckpt", tmp_path / "ckstore" / "w.bin"
    (ck / "w.bin").write_bytes(b"v1")
    assert run_dlfs("flush", m.path).returncode == 0
    reader = open(ck / "w.bin", "rb")  # noqa: SIM115 (closed while the writer writes)
    writer = os.open(ck / "w.bin", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(writer, b"v2, being written")
        reader.close()
        time.sleep(1.0)  # a closed file drains within 0.2 s, an open one once 2 s idle
        assert stored.read_bytes() == b"v1"
        wait_for(lambda: stored.read_bytes() == b"v2, being written", 30,
                 "the drain of the idle open file")
        os.pwrite(writer, b"v3", 0)
        assert run_dlfs("flush", m.path).returncode == 0  # the writer still has it open
        assert stored.read_bytes() == b"v3, being written"
        os.pwrite(writer, b"v4", 0)
    finally:
        os.close(writer)
    assert run_dlfs("flush", m.path).returncode == 0
    assert stored.read_bytes() == b"v4, being written"

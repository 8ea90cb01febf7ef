"""The checkpoint tier (docs/CKPT.md): a writable MOUNTPOINT/ckpt/ on real mounts.

POSIX calls through the mount land in the node cache and drain to the checkpoint
store, where after `dlfs flush` every file is byte-identical to what was written
(names that are not UTF-8 too); datasets stay EROFS; a daemon SIGKILLed mid-drain
leaves no half file under a real name and the next mount finishes the drain; a
read-only store keeps the local copies and drains them once it is writable again;
a root daemon mounting for a user (--uid, the Slurm prolog) lets that user, and no
other, run `dlfs flush`. The PyTorch tests live in tests/test_ckpt_torch.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import Mounter, kill_and_reap, run_dlfs, tmpfs_at, wait_dead
from sysusers import temp_user

from dlfs.runtime import user_socket_path

pytestmark = pytest.mark.usefixtures("daemon_guard")

TMP_MARK = b".dlfs-drain-"


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("ckpt-src")
    (src / "a").mkdir()
    (src / "a" / "x.bin").write_bytes(os.urandom(5000))
    return store_with(src, "ds", "64K")


def files_of(top: bytes) -> dict[bytes, str]:
    """relative path -> sha256 of every regular file under `top` (bytes names); a
    store's checksums (`.dlfs-sums` at its root, test_ckpt_sums) aside."""
    found = {}
    for directory, dirs, names in os.walk(top):
        if directory == top:
            dirs[:] = [d for d in dirs if d != b".dlfs-sums"]
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, top)] = hashlib.sha256(f.read()).hexdigest()
    return found


def read_bytes(path: bytes) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def temporaries(top: Path) -> list[bytes]:
    return [n for _, _, names in os.walk(os.fsencode(top)) for n in names if TMP_MARK in n]


def flush(mount, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_dlfs("flush", mount.path, *args, timeout=timeout)


def status_of(mount) -> dict:
    result = run_dlfs("status", mount.path, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def ckpt_mount(mounted, store: Path, tmp: Path, *extra: str):
    return mounted(store, "--cache-dir", str(tmp / "cache"), "--ckpt-store",
                   str(tmp / "ckstore"), *extra)


def test_posix_calls_in_ckpt_drain_byte_identical_and_datasets_stay_read_only(
        mounted, small_store, tmp_path):
    m = ckpt_mount(mounted, small_store, tmp_path)
    ck = os.fsencode(m.path / "ckpt")
    assert sorted(os.listdir(m.path)) == ["ckpt", "ds"]

    # create, write, read, stat
    payload = os.urandom(3 * (1 << 20) + 17)
    with open(os.path.join(ck, b"model.pt"), "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(ck, b"model.pt"), "rb") as f:
        assert f.read() == payload
    assert os.stat(os.path.join(ck, b"model.pt")).st_size == len(payload)

    # directories, a non-UTF-8 name, readdir
    os.makedirs(os.path.join(ck, b"step-1", b"\xff\xfeshard"))
    odd = os.path.join(ck, b"step-1", b"\xff\xfeshard", b"r\xe90.bin")
    with open(odd, "wb") as f:
        f.write(b"odd" * 1000)
    assert os.listdir(os.path.join(ck, b"step-1")) == [b"\xff\xfeshard"]

    # overwrite with less (O_TRUNC on an existing file), truncate, write in the middle
    with open(os.path.join(ck, b"meta.json"), "wb") as f:
        f.write(b"x" * 10_000)
    with open(os.path.join(ck, b"meta.json"), "wb") as f:
        f.write(b'{"step": 1}')
    assert read_bytes(os.path.join(ck, b"meta.json")) == b'{"step": 1}'
    os.truncate(os.path.join(ck, b"meta.json"), 4)
    fd = os.open(os.path.join(ck, b"meta.json"), os.O_RDWR)
    os.pwrite(fd, b"Z", 1)
    os.close(fd)
    assert read_bytes(os.path.join(ck, b"meta.json")) == b'{Zst'

    # write under a temporary name, rename into place (what savers do); unlink; rmdir
    with open(os.path.join(ck, b"latest.tmp"), "wb") as f:
        f.write(b"latest")
    os.rename(os.path.join(ck, b"latest.tmp"), os.path.join(ck, b"latest"))
    with open(os.path.join(ck, b"gone"), "wb") as f:
        f.write(b"gone")
    os.mkdir(os.path.join(ck, b"empty"))
    os.rmdir(os.path.join(ck, b"empty"))
    with pytest.raises(OSError) as err:
        os.rmdir(os.path.join(ck, b"step-1"))
    assert err.value.errno == errno.ENOTEMPTY

    # the datasets stay read-only
    for attempt in (lambda: (m.path / "ds" / "a" / "new").write_bytes(b"new"),
                    lambda: os.truncate(m.path / "ds" / "a" / "x.bin", 0),
                    lambda: os.close(os.open(m.path / "ds" / "a" / "x.bin",
                                             os.O_WRONLY | os.O_TRUNC)),
                    lambda: os.mkdir(m.path / "ds" / "d"),
                    lambda: os.unlink(m.path / "ds" / "a" / "x.bin"),
                    lambda: os.mkdir(m.path / "other")):
        with pytest.raises(OSError) as err:
            attempt()
        assert err.value.errno == errno.EROFS
    # ckpt/ is a file system of its own (mounted on MOUNTPOINT/ckpt): a rename from a
    # dataset into it crosses file systems (mv copies instead)
    with pytest.raises(OSError) as err:
        os.rename(m.path / "ds" / "a" / "x.bin", m.path / "ckpt" / "x")
    assert err.value.errno == errno.EXDEV

    result = flush(m)
    assert result.returncode == 0, result.stderr
    os.unlink(os.path.join(ck, b"gone"))  # after its drain: the store's copy goes too
    local = files_of(ck)
    assert set(local) == {b"model.pt", b"meta.json", b"latest",
                          os.path.join(b"step-1", b"\xff\xfeshard", b"r\xe90.bin")}
    assert files_of(os.fsencode(tmp_path / "ckstore")) == local
    assert local[b"model.pt"] == hashlib.sha256(payload).hexdigest()
    def settled() -> bool:  # the status file is rewritten each second
        ckpt = status_of(m)["ckpt"]
        return (ckpt["queued_files"] == 0 and ckpt["written_bytes"] >= len(payload)
                and ckpt["drained_bytes"] >= len(payload))

    assert wait_for(settled)
    metrics = (m.path / ".dlfs" / "metrics").read_text()
    assert "dlfs_ckpt_drained_bytes_total" in metrics


def test_flush_of_one_path_and_the_flags_it_needs(mounted, small_store, tmp_path):
    no_cache = run_dlfs("mount", tmp_path / "mp", "--store", small_store, "--ckpt-store",
                        tmp_path / "s")
    assert no_cache.returncode != 0 and "--ckpt-store needs --cache-dir" in no_cache.stderr
    m = ckpt_mount(mounted, small_store, tmp_path, "--drain-bandwidth", "64M")
    assert run_dlfs("trace", "start", m.path).returncode == 0
    (m.path / "ckpt" / "a").mkdir()
    (m.path / "ckpt" / "a" / "one").write_bytes(b"1" * 100_000)
    traced = run_dlfs("trace", "stop", m.path, "-o", tmp_path / "trace.csv")
    assert traced.returncode == 0, traced.stderr
    writes = [line.split(",") for line in (tmp_path / "trace.csv").read_text().splitlines()
              if ",write,ckpt," in line]
    assert sum(int(w[7]) for w in writes) == 100_000  # the size column
    assert {int(w[1]) for w in writes} == {os.getpid()}  # the writer's pid
    result = flush(m, str(m.path / "ckpt" / "a"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ckstore" / "a" / "one").read_bytes() == b"1" * 100_000
    outside = flush(m, str(tmp_path))
    assert outside.returncode == 2 and "not under" in outside.stderr
    assert len(outside.stderr.strip().splitlines()) == 1


def test_a_dataset_named_ckpt_is_refused_in_one_line(mounted, store_with, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"f")
    store = store_with(src, "ckpt", "64K")
    result = mounted.try_mount(store, "--cache-dir", str(tmp_path / "cache"),
                               "--ckpt-store", str(tmp_path / "ckstore"))
    assert result.returncode != 0
    assert "a dataset named ckpt" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_sigkill_mid_drain_leaves_no_half_file_and_the_next_mount_resumes(
        mounted, small_store, tmp_path):
    m = ckpt_mount(mounted, small_store, tmp_path, "--drain-bandwidth", "1M",
                   "--drain-jobs", "1")
    payload = os.urandom(6 << 20)
    (m.path / "ckpt" / "big.pt").write_bytes(payload)
    (m.path / "ckpt" / "small").write_bytes(b"small")
    store = tmp_path / "ckstore"
    deadline = time.monotonic() + 30
    while not temporaries(store) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert temporaries(store), "the drain never started"
    for pid in m.pids:
        kill_and_reap(pid) if pid == m.pid else None
    assert wait_dead(m.pid)
    assert not (store / "big.pt").exists(), "a half-drained file appeared under its name"
    run_dlfs("umount", m.path)  # the dead mount

    again = ckpt_mount(mounted, small_store, tmp_path)
    assert "still to drain" in again.log_text()
    result = flush(again, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (store / "big.pt").read_bytes() == payload
    assert (store / "small").read_bytes() == b"small"
    assert temporaries(store) == []


def test_a_read_only_store_keeps_the_local_copy_and_drains_once_writable(
        mounted, small_store, tmp_path):
    store = tmp_path / "ckstore"
    with tmpfs_at(store, "size=64m"):
        m = ckpt_mount(mounted, small_store, tmp_path)
        ro = subprocess.run(["mount", "-o", "remount,ro", str(store)], capture_output=True,
                            text=True)
        if ro.returncode:
            pytest.skip(f"cannot remount a tmpfs read-only here: {ro.stderr.strip()}")
        payload = os.urandom(1 << 20)
        (m.path / "ckpt" / "w.pt").write_bytes(payload)
        stuck = flush(m, "--timeout", "3")
        assert stuck.returncode == 1
        assert "w.pt" in stuck.stderr and "stay in the node cache" in stuck.stderr
        assert "Read-only file system" in stuck.stderr
        ckpt = status_of(m)["ckpt"]
        assert ckpt["queued_files"] == 1 and ckpt["error"]
        assert ckpt["oldest_undrained"] == "w.pt"
        assert "fails (Read-only file system" in m.log_text()
        assert (m.path / "ckpt" / "w.pt").read_bytes() == payload  # still served locally

        subprocess.run(["mount", "-o", "remount,rw", str(store)], check=True)
        result = flush(m, "--timeout", "90")
        assert result.returncode == 0, result.stderr
        assert (store / "w.pt").read_bytes() == payload
        assert "works again" in m.log_text()
        assert wait_for(lambda: status_of(m)["ckpt"]["error"] is None)  # each second
        run_dlfs("umount", m.path)


def local_blocks(tmp: Path, rel: str) -> int:
    tree = next((tmp / "cache" / "ckpt").glob("*/tree"))
    return os.stat(tree / rel).st_blocks


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_ckpt_limit_evicts_the_oldest_drained_keeps_the_newest_and_fails_enospc_when_full(
        mounted, small_store, tmp_path):
    m = ckpt_mount(mounted, small_store, tmp_path, "--ckpt-limit", "3M", "--ckpt-keep", "1",
                   "--ckpt-limit-wait", "3")
    one, two = os.urandom(2 << 20), os.urandom(2 << 20)
    (m.path / "ckpt" / "step-1").mkdir()
    (m.path / "ckpt" / "step-1" / "model.bin").write_bytes(one)
    assert flush(m).returncode == 0
    time.sleep(0.05)  # step-2 is the newer checkpoint
    (m.path / "ckpt" / "step-2").mkdir()
    (m.path / "ckpt" / "step-2" / "model.bin").write_bytes(two)
    assert flush(m).returncode == 0
    assert wait_for(lambda: local_blocks(tmp_path, "step-1/model.bin") == 0), \
        "the older drained checkpoint was not evicted"
    assert local_blocks(tmp_path, "step-2/model.bin") > 0  # the newest stays local
    assert (m.path / "ckpt" / "step-1" / "model.bin").read_bytes() == one  # from the store
    assert wait_for(lambda: status_of(m)["ckpt"]["evicted_files"] >= 1)  # rewritten each second

    # writing into an evicted file copies it back first
    with open(m.path / "ckpt" / "step-1" / "model.bin", "r+b") as f:
        f.write(b"X")
    assert (m.path / "ckpt" / "step-1" / "model.bin").read_bytes() == b"X" + one[1:]
    assert flush(m).returncode == 0
    assert (tmp_path / "ckstore" / "step-1" / "model.bin").read_bytes() == b"X" + one[1:]
    # step-1 is now the newest: step-2 goes
    assert wait_for(lambda: local_blocks(tmp_path, "step-2/model.bin") == 0)
    assert (m.path / "ckpt" / "step-2" / "model.bin").read_bytes() == two

    # the newest checkpoint alone outgrows the limit: its writes wait, then ENOSPC
    with pytest.raises(OSError) as err, \
            open(m.path / "ckpt" / "step-1" / "more.bin", "wb") as f:
        for _ in range(100):  # the limit is checked each second
            f.write(b"m" * (1 << 20))
            f.flush()
            time.sleep(0.05)
    assert err.value.errno == errno.ENOSPC
    assert (m.path / "ckpt" / "step-2" / "model.bin").read_bytes() == two  # others unharmed
    os.unlink(m.path / "ckpt" / "step-1" / "more.bin")
    assert wait_for(lambda: not status_of(m)["ckpt"]["full"])
    (m.path / "ckpt" / "step-3").write_bytes(b"fits again")
    assert flush(m).returncode == 0
    assert (tmp_path / "ckstore" / "step-3").read_bytes() == b"fits again"


def test_the_mounts_user_flushes_a_root_mount_made_for_it_and_no_other_user_may(
        small_store, tmp_path):
    """As the Slurm prolog does: root mounts with --uid; the user writes a checkpoint
    and runs `dlfs flush` itself (through the socket the daemon keeps for it); another
    user is refused in one line, by the socket's mode and, were that looser, by the
    daemon's SO_PEERCRED check."""
    base = Path(tempfile.mkdtemp(prefix="dlfs-ckptuser-", dir="/tmp"))
    base.chmod(0o755)  # users must reach the mountpoint (pytest's tmp dirs are 0700)
    store = shutil.copytree(small_store, base / "store")  # and read the datasets
    mounter = Mounter(base)
    try:
        with temp_user() as owner, temp_user() as other:
            ckstore = base / "ckstore"  # the user's, as the prolog makes it
            ckstore.mkdir(mode=0o700)
            os.chown(ckstore, owner.uid, owner.gid)
            m = mounter(store, "--uid", str(owner.uid), "--gid", str(owner.gid),
                        "--workers", "1", "--cache-dir", str(tmp_path / "cache"),
                        "--ckpt-store", str(ckstore), "--drain-bandwidth", "1M")
            m.path.parent.chmod(0o755)
            sock = user_socket_path(os.path.realpath(m.path))
            st = os.stat(sock)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (owner.uid, 0o600)
            st = os.stat(sock.parent)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
            wrote = owner.run("sh", "-c", f"head -c 2000000 /dev/urandom > {m.path}/ckpt/s.pt"
                              f" && sha256sum < {m.path}/ckpt/s.pt")
            assert wrote.returncode == 0, wrote.stderr
            flushed = owner.dlfs("flush", str(m.path))
            assert flushed.returncode == 0, flushed.stderr
            assert "flushed" in flushed.stdout
            stored = (ckstore / "s.pt").read_bytes()  # 2 s at 1M/s: not early
            assert (ckstore / "s.pt").stat().st_uid == owner.uid
            assert hashlib.sha256(stored).hexdigest() == wrote.stdout.split()[0]

            refused = other.dlfs("flush", str(m.path))
            assert refused.returncode == 1
            assert refused.stderr.count("\n") == 1 and "permission denied" in refused.stderr
            os.chmod(sock, 0o666)  # past the socket's mode: the daemon still says no
            refused = other.dlfs("flush", str(m.path))
            assert refused.returncode == 1 and refused.stderr.count("\n") == 1
            assert f"not uid {other.uid}" in refused.stderr, refused.stderr
            untraced = owner.dlfs("trace", "status", str(m.path))  # the trace stays root's
            assert untraced.returncode == 1 and "permission denied" in untraced.stderr
            assert run_dlfs("umount", m.path).returncode == 0
            assert not sock.exists(), "the user's socket outlived the mount"
    finally:
        mounter.cleanup()
        shutil.rmtree(base, ignore_errors=True)

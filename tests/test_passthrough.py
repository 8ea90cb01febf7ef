"""Large files by FUSE passthrough (issue 32): the kernel reads verified whole-file copies.

Three layers. The decision (dlfsd.core.passthrough.decide/granted, and what INIT asks and
gets from kernels with and without FUSE_PASSTHROUGH) and the open table
(PassthroughOpens: one mode and one backing id per inode while it is open) are driven
directly. The whole-file copies (dlfsd.pool.filecopies) are made from a real store: a
bad store extent publishes nothing. Then real mounts (root, Linux >= 6.9; they skip
saying why elsewhere): large files read byte-exact with no READ reaching the daemon,
a copy damaged on disk before an open (in this mount, or left by an earlier one) is
never served, a mount of mostly small files keeps no_open, and a daemon that is not
root serves everything itself.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import force_unmount, populate_store, run_dlfs
from sysusers import site_env, temp_user
from test_ckpt_nonroot import fuse_for_users  # noqa: F401 (a fixture)
from test_fuse_init import KERNEL_6_9, KERNEL_6_18, OLD_FLAGS, decode, init_request

from dlfs.errors import CorruptDataError
from dlfs.store import nodecache
from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfs.store.store import Store
from dlfsd.core import passthrough as pt
from dlfsd.fuse import rawsession as rs
from dlfsd.pool.chunkcache import ChunkCache
from dlfsd.pool.filecopies import ABSENT, FILE_DEMAND, PRESENT, VERIFIED, FileCopies

pytestmark = pytest.mark.usefixtures("daemon_guard")

CHUNK = "1M"  # large files: 1 MiB or more (at least a quarter chunk); extents of 1 MiB
LARGE = {"vol/a.bin": 3 * 2**20 + 12345, "vol/b.bin": 2**20, "vol/c.bin": 1_500_000}
SMALL = {f"small/{i:03d}.txt": 1000 + 37 * i for i in range(40)}


def make_tree(root: Path, files: dict[str, int]) -> dict[str, bytes]:
    out = {}
    for rel, size in files.items():
        data = hashlib.shake_256(rel.encode()).digest(size)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


@pytest.fixture
def mixed(tmp_path):
    """A store whose bytes are mostly large files: (store, {path: bytes})."""
    src = tmp_path / "src"
    data = make_tree(src, {**LARGE, **SMALL})
    return populate_store(src, tmp_path / "store", "ds", CHUNK), data


def status(mount) -> dict:
    done = run_dlfs("status", mount.path, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def wait_for(what: str, condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def passthrough_status(mount, predicate, what: str) -> dict:
    """The mount's passthrough report once `predicate` holds (rewritten every second)."""
    return wait_for(what, lambda: (lambda p: p if predicate(p) else None)(
        status(mount).get("passthrough", {})))


def passthrough_mount(mounted, store: Path, cache: Path, *extra: str):
    """A mount serving large files by passthrough, its copies all verified; skips where
    the daemon may not (not root, an old kernel) with the reason the daemon gives."""
    m = mounted(store, "--cache-dir", str(cache), *extra)
    mode = status(m)["passthrough"]["mode"]
    if not mode.startswith("on"):
        pytest.skip(f"large files by passthrough: {mode}")
    passthrough_status(m, lambda p: p["verified_copies"] == p["large_files"] == len(LARGE),
                       "every whole-file copy verified")
    return m


def copy_path(cache: Path, store: Path, rel: str) -> Path:
    """The whole-file copy of `rel` in the node cache."""
    ds = Store(store).open("ds")
    return cache / ds.uuid.hex() / f"{_row_of(ds.directory, rel)}.file"


def _row_of(directory, rel: str) -> int:
    row = 0
    for part in rel.encode().split(b"/"):
        row = directory.lookup(row, part)
        assert row >= 0, rel
    return row


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def corrupt(path: Path, at: int) -> None:
    """Flip bytes of the file in place (what bit rot or a stray writer does)."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 2, at)
        os.pwrite(fd, bytes(b ^ 0xFF for b in old), at)
    finally:
        os.close(fd)


# -- the decision -----------------------------------------------------------------------
def fake_dataset(sizes: list[int], chunk_size: int = 1 << 20):
    modes = np.array([0o040755] + [0o100644] * len(sizes), dtype="<u2")
    arrays = {"size": np.array([0, *sizes], dtype="<u8"), "mode": modes}
    return SimpleNamespace(directory=SimpleNamespace(arrays=arrays), chunk_size=chunk_size)


def test_the_mount_decides_by_who_runs_it_its_cache_dir_and_its_bytes():
    mostly_large = [fake_dataset([4 << 20, 1000, 2000])]
    mostly_small = [fake_dataset([3 << 20] + [(1 << 20) - 1] * 10)]  # 23%: under 1 MiB each
    no_large = [fake_dataset([1000] * 5, chunk_size=4096)]  # a quarter chunk, not 1 MiB
    assert pt.decide("off", 0, True, mostly_large) == (False, "off (--passthrough off)")
    wanted, why = pt.decide("on", 1000, True, mostly_large)
    assert not wanted and why.startswith("off (needs root")
    wanted, why = pt.decide("auto", 0, False, mostly_large)
    assert not wanted and "--cache-dir" in why
    wanted, why = pt.decide("on", 0, True, no_large)
    assert not wanted and "no large files" in why
    wanted, why = pt.decide("auto", 0, True, mostly_small)
    assert not wanted and why.startswith("off (auto: large files hold 23% of the bytes")
    assert pt.decide("on", 0, True, mostly_small) == (
        True, "on (large files hold 23% of the bytes)")
    assert pt.decide("auto", 0, True, mostly_large)[0]
    # after INIT: an old kernel did not grant it
    wanted, why = pt.granted(True, "on", False, "6.8.0")
    assert not wanted and why.startswith("off (kernel 6.8.0 does not offer FUSE passthrough")
    assert pt.granted(True, "on", True, "6.18.0") == (True, "on")
    assert pt.granted(False, "off (x)", False, "6.8.0") == (False, "off (x)")


def test_init_asks_for_passthrough_only_when_the_mount_wants_it():
    reply, got = rs.negotiate(init_request(*KERNEL_6_18), rs.dataset_wants(600))
    assert not got.passthrough and decode(reply)["max_stack_depth"] == 0
    reply, got = rs.negotiate(init_request(*KERNEL_6_9), rs.dataset_wants(600, True))
    assert got.passthrough and decode(reply)["max_stack_depth"] == rs.MAX_STACK_DEPTH
    # a kernel before 6.9 offers none: nothing is granted, the workers keep no_open
    reply, got = rs.negotiate(init_request(39, OLD_FLAGS | rs.INIT_EXT),
                              rs.dataset_wants(600, True))
    out = decode(reply)
    assert not got.passthrough and not out["flags"] & rs.PASSTHROUGH
    assert out["max_stack_depth"] == 0


# -- the open table ----------------------------------------------------------------------
class FakeCopies:
    """Two large files (rows 5 and 9); `good[i]`: the copy is verified and unchanged."""

    def __init__(self, tmp: Path) -> None:
        self.rows = np.array([5, 9])
        self.good = [True, True]
        self.file = tmp / "copy"
        self.file.write_bytes(b"x")

    def __len__(self) -> int:
        return len(self.rows)

    def open_verified(self, i: int) -> int:
        return os.open(self.file, os.O_RDONLY) if self.good[i] else -1

    def path(self, i: int) -> Path:
        return self.file

    def counts(self):
        return len(self.rows), sum(self.good), 0, 0

    def close(self) -> None:
        pass


def test_one_mode_and_one_backing_id_per_inode_while_it_is_open(tmp_path):
    copies = FakeCopies(tmp_path)
    demanded, registered, unregistered = [], [], []
    opens = pt.PassthroughOpens(SimpleNamespace(inode_of=lambda k, row: 1000 + row),
                                [None, copies], lambda ds, n: demanded.append((ds, n)))

    def register(fd: int) -> int:
        os.fstat(fd)  # an open descriptor of the verified copy
        registered.append(fd)
        return 40 + len(registered)

    a, b = 1005, 1009
    assert opens.opened(1000, register) == -1  # not a large file: served, not counted
    assert opens.opened(a, register) == 41 and opens.opened(a, register) == 41
    assert len(registered) == 1  # the second open shares the first one's backing id
    opens.released(a, unregistered.append)
    assert unregistered == []
    opens.released(a, unregistered.append)
    assert unregistered == [41]  # the last close
    opens.released(a, unregistered.append)  # a stray RELEASE changes nothing
    assert unregistered == [41]

    copies.good[1] = False  # no verified copy: served, and the copy demanded
    assert opens.opened(b, register) == 0
    assert demanded == [(1, FILE_DEMAND | 1)]
    copies.good[1] = True  # verified meanwhile: still served while that open lasts
    assert opens.opened(b, register) == 0 and len(registered) == 1
    opens.released(b, unregistered.append)
    opens.released(b, unregistered.append)
    assert opens.opened(b, register) == 42  # now passed through

    copies.good[1] = False  # changed on disk while the kernel reads it: refused
    with pytest.raises(pt.PassthroughError) as refused:
        opens.opened(b, register)
    assert refused.value.errno == errno.EIO
    copies.good[1] = True  # made again (another file) while that open lasts: refused too
    new = copies.file.with_name("new")
    new.write_bytes(b"y")  # made while the old one exists: another inode
    new.rename(copies.file)
    with pytest.raises(pt.PassthroughError):
        opens.opened(b, register)
    opens.released(b, unregistered.append)
    assert unregistered == [41, 42]
    assert opens.opened(b, register) == 43  # the new copy, once the old one is closed
    opens.released(b, unregistered.append)
    report = opens.report()
    assert (report["opens_passed"], report["opens_served"], report["open_now"]) == (4, 2, 0)
    opens.close()


# -- the copies, from a real store -------------------------------------------------------------
def test_a_copy_is_checked_extent_by_extent_as_written_and_a_bad_one_never_published(mixed,
                                                                                      tmp_path):
    store, data = mixed
    dataset = Store(store).open("ds")
    cache = ChunkCache(tmp_path / "cache", dataset)
    cache.scan()
    copies = FileCopies(cache, np.ones(dataset.chunk_count, dtype=bool))
    try:
        assert len(copies) == len(LARGE)
        buffer = bytearray(dataset.directory.extent_size)
        never = lambda: False  # noqa: E731
        i = copies.index[_row_of(dataset.directory, "vol/a.bin")]
        assert copies.stage(i, buffer, never) == "copied"
        assert copies.state(i) == VERIFIED
        assert copies.path(i).read_bytes() == data["vol/a.bin"]
        fd = copies.open_verified(i)
        assert fd >= 0
        os.close(fd)
        corrupt(copies.path(i), 2 * 2**20 + 7)  # changed on disk: not served as it is
        assert copies.open_verified(i) == -1 and copies.state(i) == PRESENT
        assert copies.stage(i, buffer, never) == "copied"  # checked, bad, copied again
        assert copies.path(i).read_bytes() == data["vol/a.bin"]

        # a bad extent in the store: the copy is never published, nothing is left
        j = copies.index[_row_of(dataset.directory, "vol/b.bin")]
        d = dataset.directory
        ext = d.first_extent(int(copies.rows[j]))
        chunk_file = dataset.chunk_path(d.ext_chunk_view[ext])
        corrupt(Path(chunk_file), CHUNK_HEADER_SIZE + d.ext_offset_view[ext] + 100)
        with pytest.raises(CorruptDataError):
            copies.stage(j, buffer, never)
        assert copies.state(j) == ABSENT and not copies.path(j).exists()
        assert not [p for p in cache.dir.iterdir() if p.name.startswith(".tmp-")]
    finally:
        copies.close()
        cache.close()


# -- real mounts ------------------------------------------------------------------------------
def test_large_files_pass_through_byte_exact_small_ones_are_served(mounted, mixed, tmp_path):
    store, data = mixed
    m = passthrough_mount(mounted, store, tmp_path / "cache")
    for rel in LARGE:
        assert sha((m / f"ds/{rel}").read_bytes()) == sha(data[rel]), rel
    small = 0
    for rel in SMALL:
        assert (m / f"ds/{rel}").read_bytes() == data[rel], rel
        small += len(data[rel])
    # mapped, and two opens of one file at once (one backing id for both)
    with open(m / "ds/vol/a.bin", "rb") as f, open(m / "ds/vol/a.bin", "rb") as g:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            assert sha(mapped[:]) == sha(data["vol/a.bin"])
        assert g.read() == data["vol/a.bin"]
        passthrough_status(m, lambda p: p["passthrough_now"] == 1 and p["open_now"] == 1,
                           "one backing id for both opens")
    report = passthrough_status(m, lambda p: p["opens_passed"] >= len(LARGE) + 2
                                and p["open_now"] == 0, "the opens counted and closed")
    assert report["opens_served"] == 0
    # no READ of a large file reached the daemon: it read the small files only
    sources = status(m)["datasets"][0]["sources"]
    assert sum(s["bytes"] for s in sources.values()) == small
    stats = json.loads(run_dlfs("stats", m.path, "--json").stdout)
    assert stats["opens_counted"] and stats["mount"]["opens"] >= len(LARGE) + len(SMALL)
    # `dlfs cache ls` counts chunk copies as chunks, and every copy's bytes
    (cached,) = nodecache.datasets(tmp_path / "cache")
    dataset = Store(store).open("ds")
    assert cached.chunks == dataset.chunk_count
    assert cached.bytes == (int(dataset.chunk_lengths.sum()) + CHUNK_HEADER_SIZE
                            * dataset.chunk_count + sum(LARGE.values()))


def test_a_copy_damaged_on_disk_before_an_open_is_never_served(mounted, mixed, tmp_path):
    store, data = mixed
    cache = tmp_path / "cache"
    m = passthrough_mount(mounted, store, cache)
    rel, want = "vol/a.bin", data["vol/a.bin"]
    copy = copy_path(cache, store, rel)
    corrupt(copy, 3 * 2**20 + 5)
    assert (m / f"ds/{rel}").read_bytes() == want  # served by the daemon instead
    passthrough_status(m, lambda p: p["opens_served"] == 1, "the open served")
    # the stager checks the copy, finds the bad extent, copies it again
    passthrough_status(m, lambda p: p["verified_copies"] == len(LARGE), "a good copy again")
    assert copy.read_bytes() == want
    log = m.log_text()
    assert "it changed on disk since it was checked" in log
    assert "checksum mismatch in extent" in log and "copying it again" in log
    assert (m / f"ds/{rel}").read_bytes() == want
    passthrough_status(m, lambda p: p["opens_passed"] == 1, "passed through again")

    # damaged while the kernel reads it through passthrough: further opens fail (EIO)
    # until the open ones close; then the daemon serves it, and the copy is made again
    # until the open ones close, even once the copy was made again (another file)
    with open(m / f"ds/{rel}", "rb"):
        corrupt(copy, 5)
        with pytest.raises(OSError) as refused:
            open(m / f"ds/{rel}", "rb").close()
        assert refused.value.errno == errno.EIO
        passthrough_status(m, lambda p: p["verified_copies"] == len(LARGE), "the new copy")
        with pytest.raises(OSError) as refused:
            open(m / f"ds/{rel}", "rb").close()
        assert refused.value.errno == errno.EIO
    wait_for("the last close", lambda: status(m)["passthrough"]["open_now"] == 0)
    assert (m / f"ds/{rel}").read_bytes() == want
    passthrough_status(m, lambda p: p["opens_passed"] == 3, "the new copy passed through")


def test_a_damaged_copy_an_earlier_mount_left_is_checked_before_passthrough(
        mounted, mixed, tmp_path):
    store, data = mixed
    cache = tmp_path / "cache"
    first = passthrough_mount(mounted, store, cache)
    assert run_dlfs("umount", first.path).returncode == 0
    rel, want = "vol/c.bin", data["vol/c.bin"]
    copy = copy_path(cache, store, rel)
    before = copy.stat()
    corrupt(copy, 1_300_000)
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime as it was
    m = mounted(store, "--cache-dir", str(cache))
    assert (m / f"ds/{rel}").read_bytes() == want  # adopted unverified: not passed
    passthrough_status(m, lambda p: p["verified_copies"] == len(LARGE), "copies checked")
    assert copy.read_bytes() == want
    assert "is bad (checksum mismatch in extent" in m.log_text()
    for name in LARGE:
        assert (m / f"ds/{name}").read_bytes() == data[name]


def test_a_mount_of_mostly_small_files_keeps_no_open_unless_told(mounted, tmp_path):
    src = tmp_path / "src"
    data = make_tree(src, {"vol/one.bin": 1 << 20,
                           **{f"s/{i:03d}": 20_000 for i in range(150)}})  # 26% large
    store = populate_store(src, tmp_path / "store", "ds", CHUNK)
    auto = mounted(store, "--cache-dir", str(tmp_path / "cache-auto"))
    mode = status(auto)["passthrough"]["mode"]
    assert mode.startswith("off (auto: large files hold 2"), mode
    for rel, want in data.items():
        assert (auto / f"ds/{rel}").read_bytes() == want
    stats = json.loads(run_dlfs("stats", auto.path, "--json").stdout)
    assert not stats["opens_counted"] and stats["mount"]["opens"] == 0  # no_open
    human = run_dlfs("status", auto.path).stdout
    assert "large files by passthrough: off (auto:" in human
    forced = mounted(store, "--cache-dir", str(tmp_path / "cache-on"), "--passthrough", "on")
    mode = status(forced)["passthrough"]["mode"]
    if not mode.startswith("on"):
        pytest.skip(f"large files by passthrough: {mode}")
    passthrough_status(forced, lambda p: p["verified_copies"] == p["large_files"] == 1,
                       "the copy verified")
    for rel, want in data.items():
        assert (forced / f"ds/{rel}").read_bytes() == want
    passthrough_status(forced, lambda p: p["opens_passed"] == 1, "the large file passed")


def test_a_daemon_that_is_not_root_serves_large_files_itself(fuse_for_users,  # noqa: F811
                                                             tmp_path):
    base = Path(tempfile.mkdtemp(prefix="dlfs-pt-nonroot-", dir="/tmp"))
    base.chmod(0o755)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, base, True)
        src = base / "src"
        data = make_tree(src, LARGE)
        store, mnt, cache = base / "store", base / "mnt", base / "cache"
        populate_store(src, store, "ds", CHUNK)
        for directory, _, files in os.walk(store):
            os.chmod(directory, 0o755)
            for name in files:
                os.chmod(os.path.join(directory, name), 0o644)
        user = cleanup.enter_context(temp_user())
        cleanup.callback(shutil.rmtree, Path(f"/tmp/dlfs-{user.uid}"), True)
        for path in (mnt, cache):
            path.mkdir()
            os.chown(path, user.uid, user.gid)
        env = site_env(base / "site")
        cleanup.callback(force_unmount, mnt)
        log = cache / "dlfsd.log"
        done = user.dlfs("mount", str(mnt), "--store", str(store), "--cache-dir", str(cache),
                         "--passthrough", "on", "--workers", "1", "--log-file", str(log),
                         env=env)
        assert done.returncode == 0, done.stderr + (log.read_text() if log.exists() else "")
        got = json.loads(user.dlfs("status", str(mnt), "--json", env=env).stdout)
        assert got["passthrough"]["mode"].startswith("off (needs root"), got["passthrough"]
        for rel, want in data.items():
            read = user.run("sha256sum", str(mnt / "ds" / rel))
            assert read.returncode == 0 and read.stdout.split()[0] == sha(want), read.stderr
        assert "large files by FUSE passthrough: off (needs root" in log.read_text()
        assert user.dlfs("umount", str(mnt), env=env).returncode == 0

"""A job's user attacks the root daemon through its checkpoint tier (issue 29).

The Slurm prolog mounts as root with --uid/--gid and a checkpoint store the user owns.
Each test here is a throw-away user doing what such a user can: swap a store directory
for a symlink to a root-only directory, race that swap, plant links in `ckpt/`, send
flush paths that lead outside. Root's files must stay unread, unwritten, unremoved and
unchanged, and the daemon must refuse in one line where it is asked something it will
not do (docs/SECURITY.md). Each test fails on the tier that acted as root by paths.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Mount, Mounter, run_dlfs
from sysusers import User, temp_user

from dlfs.errors import DlfsError
from dlfs.obs.traceclient import _connect, _request

SECRET = b"root's secret\n"


@dataclass
class Attack:
    mount: Mount
    user: User
    store: Path  # the checkpoint store, the user's
    probe: Path  # root's: 0700, holding a 0600 secret

    @property
    def ckpt(self) -> Path:
        return self.mount.path / "ckpt"

    def sh(self, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.user.run("sh", "-c", script, timeout=timeout)

    def probe_state(self) -> dict:
        """Every entry of the probe directory with its mode, owner and bytes."""
        return {p.name: (p.stat().st_mode, p.stat().st_uid, p.read_bytes())
                for p in sorted(self.probe.iterdir())}


@pytest.fixture
def attack(store_with, tmp_path_factory):
    src = tmp_path_factory.mktemp("sec-src")
    (src / "f").write_bytes(b"sample")
    datasets = store_with(src, "ds", "64K")
    base = Path(tempfile.mkdtemp(prefix="dlfs-sec-", dir="/tmp"))
    base.chmod(0o755)  # the user reaches the mountpoint and the store
    store = shutil.copytree(datasets, base / "datasets")
    probe = base / "probe"
    probe.mkdir(mode=0o700)
    (probe / "secret").write_bytes(SECRET)
    (probe / "secret").chmod(0o600)
    mounter = Mounter(base)
    try:
        with temp_user("dlfsx") as user:
            ckstore = base / "ckstore"
            ckstore.mkdir(mode=0o700)
            os.chown(ckstore, user.uid, user.gid)
            mount = mounter(store, "--uid", str(user.uid), "--gid", str(user.gid),
                            "--workers", "2", "--cache-dir", str(base / "cache"),
                            "--ckpt-store", str(ckstore))
            mount.path.parent.chmod(0o755)
            yield Attack(mount, user, ckstore, probe)
    finally:
        mounter.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def swap_for_link(a: Attack, name: str) -> None:
    """The issue's first move: a directory made through ckpt/ (so mirrored on the store),
    its store side then replaced by a symlink to root's directory."""
    done = a.sh(f"mkdir {a.ckpt}/{name} && rmdir {a.store}/{name} && "
                f"ln -s {a.probe} {a.store}/{name}")
    assert done.returncode == 0, done.stderr


def test_a_store_symlink_does_not_read_a_root_only_file(attack):
    before = attack.probe_state()
    swap_for_link(attack, "d")
    read = attack.sh(f"cat {attack.ckpt}/d/secret")
    assert read.returncode != 0 and SECRET.decode() not in read.stdout
    listed = attack.sh(f"ls -a {attack.ckpt}/d")
    assert "secret" not in listed.stdout
    assert attack.probe_state() == before


def test_a_store_symlink_does_not_let_root_write_or_unlink_there(attack):
    before = attack.probe_state()
    swap_for_link(attack, "d")
    wrote = attack.sh(f"echo hi > {attack.ckpt}/d/written")
    assert wrote.returncode == 0, wrote.stderr  # it is the user's own local file
    flushed = run_dlfs("flush", attack.mount.path, "--timeout", "5")
    assert flushed.returncode != 0  # the drain refuses the link: nothing drained
    assert len(flushed.stderr.strip().splitlines()) == 1, flushed.stderr
    attack.sh(f"rm -f {attack.ckpt}/d/secret")
    assert attack.probe_state() == before, "root wrote or removed through the user's link"
    assert (attack.ckpt / "d" / "written").read_bytes() == b"hi\n"  # kept locally


def test_the_tree_refuses_a_symlinks_mode_and_size(tmp_path):
    """SETATTR of a symlink's mode would be its target's with a path-based chmod (the
    kernel here refuses to send one, 6.x: so the core itself is asked, no mount)."""
    from dlfsd.ckpt.tier import Tier
    from dlfsd.ckpt.tree import CkptTree, PosixError

    target = tmp_path / "root-only"
    target.write_bytes(SECRET)
    target.chmod(0o600)
    (tmp_path / "ckstore").mkdir()
    tier = Tier(str(tmp_path / "cache"), str(tmp_path / "ckstore"))
    try:
        tree = CkptTree(tier)
        link = tree.symlink(tree.root_nodeid, b"l", os.fsencode(target))
        with pytest.raises(PosixError) as mode:
            tree.setattr(link.ino, mode=0o666)
        with pytest.raises(PosixError) as size:
            tree.setattr(link.ino, size=0)
        assert (mode.value.errno, size.value.errno) == (errno.EPERM, errno.EINVAL)
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
        assert target.read_bytes() == SECRET
        tree.setattr(link.ino, mtime_ns=10**18)  # times: on the link itself
        assert os.lstat(tmp_path / "ckstore" / "l").st_mtime_ns != 10**18  # (local only)
        assert target.stat().st_mtime_ns != 10**18
    finally:
        tier.close()


def test_the_rename_race_of_a_store_directory_never_leads_outside(attack):
    """The store's `d` flips between a directory and a symlink to root's directory,
    2000 times, while the user reads and writes under ckpt/d and drains."""
    before = attack.probe_state()
    made = attack.sh(f"mkdir {attack.ckpt}/d && echo mine > {attack.ckpt}/d/mine")
    assert made.returncode == 0, made.stderr
    assert run_dlfs("flush", attack.mount.path).returncode == 0
    s = attack.store
    swapper = subprocess.Popen(
        ["runuser", "-u", attack.user.name, "--", "sh", "-c",
         f"i=0; while [ $i -lt 2000 ]; do mv {s}/d {s}/d.real; ln -s {attack.probe} {s}/d; "
         f"rm {s}/d; mv {s}/d.real {s}/d; i=$((i+1)); done"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    leaked = []
    try:
        deadline = time.monotonic() + 60
        while swapper.poll() is None and time.monotonic() < deadline:
            got = attack.sh(f"cat {attack.ckpt}/d/secret 2>/dev/null; "
                            f"echo x > {attack.ckpt}/d/w 2>/dev/null; "
                            f"rm -f {attack.ckpt}/d/secret 2>/dev/null; true")
            if SECRET.decode() in got.stdout:
                leaked.append(got.stdout)
    finally:
        swapper.kill()
        swapper.wait()
    run_dlfs("flush", attack.mount.path, "--timeout", "10")
    assert not leaked, "root read a root-only file through the store's swapped directory"
    assert attack.probe_state() == before


@pytest.mark.parametrize("where", ["link", "dotdot", "absolute"])
def test_flush_refuses_a_path_that_leads_outside_in_one_line(attack, where):
    made = attack.sh(f"ln -s {attack.probe} {attack.ckpt}/link")
    assert made.returncode == 0, made.stderr
    under = {"link": b"link", "dotdot": b"../..", "absolute": os.fsencode(attack.probe)}
    # What the daemon is sent (the CLI, given a path, sends it relative to ckpt/): the
    # user's own socket takes the same command, so the daemon must check it itself.
    with _connect(str(attack.mount.path)) as sock, pytest.raises(DlfsError) as refused:
        _request(sock, f"ckpt-flush {under[where].hex()}")
    assert "cannot flush" in str(refused.value) and "\n" not in str(refused.value)
    if where == "link":
        cli = attack.user.dlfs("flush", str(attack.ckpt / "link"))
        assert cli.returncode != 0 and len(cli.stderr.strip().splitlines()) == 1


def test_a_0600_checkpoint_stays_0600_and_the_users_on_the_store(attack):
    made = attack.sh(f"umask 077; echo weights > {attack.ckpt}/model.pt")
    assert made.returncode == 0, made.stderr
    assert run_dlfs("flush", attack.mount.path).returncode == 0
    st = (attack.store / "model.pt").stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert (st.st_uid, st.st_gid) == (attack.user.uid, attack.user.gid)


def test_a_root_mount_for_a_user_never_creates_the_store_through_its_links(
        store_with, tmp_path_factory):
    """The store's path may run through a directory the user owns: a symlink planted
    there must not make root create directories where it points."""
    src = tmp_path_factory.mktemp("sec-src2")
    (src / "f").write_bytes(b"sample")
    datasets = store_with(src, "ds", "64K")
    base = Path(tempfile.mkdtemp(prefix="dlfs-sec-", dir="/tmp"))
    base.chmod(0o755)
    probe = base / "probe"
    probe.mkdir(mode=0o700)
    mounter = Mounter(base)
    try:
        with temp_user("dlfsx") as user:
            users = base / "users"
            users.mkdir()
            os.chown(users, user.uid, user.gid)
            made = user.run("ln", "-s", str(probe), str(users / "j"))
            assert made.returncode == 0, made.stderr
            result = mounter.try_mount(datasets, "--uid", str(user.uid), "--gid",
                                       str(user.gid), "--cache-dir", str(base / "cache"),
                                       "--ckpt-store", str(users / "j" / "new"))
            assert result.returncode != 0
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert "does not create it" in result.stderr
            assert list(probe.iterdir()) == [], "root made a directory through the link"
    finally:
        mounter.cleanup()
        shutil.rmtree(base, ignore_errors=True)

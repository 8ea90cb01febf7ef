"""`dlfs mount --uid --gid`: a mount made for one user (what the Slurm prolog does).

Every entry shows that owner, the root is 0700 with allow_other: the user reads
everything, any other user cannot even list the root.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from conftest import Mounter
from sysusers import temp_user
from trees import make_small_tree

pytestmark = pytest.mark.usefixtures("daemon_guard")


@pytest.fixture(scope="module")
def private(tmp_path_factory, store_with):
    """(mount, source, owner, other): the mount and the store live under a 0755 dir in
    /tmp so that other users can reach the mountpoint at all (pytest's tmp dirs are
    0700), and the owner may read the store (a root daemon serves it only that)."""
    src = tmp_path_factory.mktemp("private") / "src"
    make_small_tree(src, files=6)
    base = Path(tempfile.mkdtemp(prefix="dlfs-private-", dir="/tmp"))
    base.chmod(0o755)
    store = store_with(src, "ds", "256K", base / "store")  # the user must read it too
    mounter = Mounter(base)
    try:
        with temp_user() as owner, temp_user() as other:
            mount = mounter(store, "--uid", str(owner.uid), "--gid", str(owner.gid),
                            "--workers", "1")
            mount.path.parent.chmod(0o755)
            yield mount, src, owner, other
    finally:
        mounter.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def test_root_is_0700_and_owned_by_the_user(private):
    mount, _, owner, _ = private
    st = os.stat(mount.path)
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert (st.st_uid, st.st_gid) == (owner.uid, owner.gid)


def test_every_entry_shows_the_owner(private):
    mount, _, owner, _ = private
    for dirpath, dirnames, filenames in os.walk(mount.path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            assert (st.st_uid, st.st_gid) == (owner.uid, owner.gid), name


def test_owner_reads_identical_bytes(private):
    mount, src, owner, _ = private
    rel = "ds/d0/f000.bin"
    result = owner.run("sha256sum", str(mount / rel))
    assert result.returncode == 0, result.stderr
    result_src = os.popen(f"sha256sum {src / 'd0/f000.bin'}").read().split()[0]
    assert result.stdout.split()[0] == result_src


def test_other_user_cannot_enter(private):
    mount, _, _, other = private
    listing = other.run("ls", str(mount.path))
    assert listing.returncode != 0 and "Permission denied" in listing.stderr
    reading = other.run("cat", str(mount / "ds/d0/f000.bin"))
    assert reading.returncode != 0 and "Permission denied" in reading.stderr

"""A daemon that is not root, with a checkpoint directory (docs/CKPT.md), on real mounts
by a real unprivileged user.

It mounts through fusermount3, which (setuid root) may not look inside the user's own
FUSE mount: the kernel lets only the mount's owner in, root included only with
allow_other. So the checkpoint connection is mounted in the user's runtime directory
and MOUNTPOINT/ckpt is a symlink to it. Checked: write, list, flush, read back, store
byte-exact; `dlfs umount` (the user's, and root's) takes both mounts down; after a
SIGKILL of the daemon the next `dlfs mount` detaches both stale mounts and serves the
same checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path

import pytest
from conftest import (
    force_unmount,
    kill_and_reap,
    main_daemon_pids,
    mounts_by_path,
    populate_store,
    require_fuse,
    run_dlfs,
)
from sysusers import require_useradd, site_env, temp_user

from dlfs.mountinfo import CKPT_FSTYPE

pytestmark = pytest.mark.usefixtures("daemon_guard")


@pytest.fixture
def fuse_for_users():
    """/dev/fuse usable by every user, as Debian ships it (0666). Some VMs make it
    root-only (0600): then it is opened up for this test and put back after."""
    require_fuse()
    require_useradd()
    fusermount = shutil.which("fusermount3")
    if fusermount is None or not os.stat(fusermount).st_mode & stat.S_ISUID:
        pytest.skip("fusermount3 is not setuid root: users cannot mount FUSE here")
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", mode | 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


def ckpt_mounts(uid: int) -> list[str]:
    """The checkpoint connections mounted in `uid`'s fallback runtime dir."""
    prefix = f"/tmp/dlfs-{uid}/"
    return [mp for mp, fstype in mounts_by_path().items()
            if fstype == CKPT_FSTYPE and mp.startswith(prefix)]


def test_a_users_daemon_mounts_ckpt_outside_and_links_it(fuse_for_users, tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"sample" * 100)
    base = Path(tempfile.mkdtemp(prefix="dlfs-nonroot-", dir="/tmp"))
    base.chmod(0o755)  # the user must reach everything (pytest's tmp dirs are 0700)
    store, mnt, ckstore = base / "store", base / "mnt", base / "ckstore"
    populate_store(src, store)
    mnt.mkdir()
    with temp_user() as user, contextlib.ExitStack() as cleanup:
        runtime = Path(f"/tmp/dlfs-{user.uid}")
        cleanup.callback(shutil.rmtree, runtime, True)
        cleanup.callback(shutil.rmtree, base, True)
        log = base / "logs" / "dlfsd.log"
        for path in (mnt, ckstore, base / "cache", log.parent):
            path.mkdir(exist_ok=True)
            os.chown(path, user.uid, user.gid)
        for directory, _, files in os.walk(store):
            os.chmod(directory, 0o755)
            for name in files:
                os.chmod(os.path.join(directory, name), 0o644)
        env = site_env(base / "site")

        def unmount_all() -> None:
            force_unmount(mnt)
            for mp in ckpt_mounts(user.uid):
                force_unmount(Path(mp))

        cleanup.callback(unmount_all)

        def mount() -> None:
            done = user.dlfs("mount", str(mnt), "--store", str(store), "--cache-dir",
                             str(base / "cache"), "--ckpt-store", str(ckstore),
                             "--workers", "1", "--log-file", str(log), env=env)
            assert done.returncode == 0, done.stderr + (log.read_text() if log.exists()
                                                         else "")

        mount()
        outside = ckpt_mounts(user.uid)
        assert len(outside) == 1, mounts_by_path()
        link = user.run("readlink", str(mnt / "ckpt"))
        assert link.stdout.strip() == outside[0]

        wrote = user.run("sh", "-c", f"mkdir {mnt}/ckpt/step-1 && head -c 3000000 "
                         f"/dev/urandom > {mnt}/ckpt/step-1/model.pt && "
                         f"sha256sum < {mnt}/ckpt/step-1/model.pt && ls {mnt}/ckpt")
        assert wrote.returncode == 0, wrote.stderr
        digest, listing = wrote.stdout.split()[0], wrote.stdout.split()[2:]
        assert listing == ["step-1"]
        flushed = user.dlfs("flush", str(mnt), env=env)
        assert flushed.returncode == 0, flushed.stderr
        stored = (ckstore / "step-1" / "model.pt").read_bytes()
        assert hashlib.sha256(stored).hexdigest() == digest
        assert os.stat(ckstore / "step-1" / "model.pt").st_uid == user.uid

        # killed: both mounts stay behind, dead; the next mount clears them
        for pid in main_daemon_pids(mnt):
            os.kill(pid, signal.SIGKILL)
            kill_and_reap(pid)
        assert ckpt_mounts(user.uid) == outside
        mount()
        assert ckpt_mounts(user.uid) == outside
        read = user.run("sha256sum", f"{mnt}/ckpt/step-1/model.pt")
        assert read.returncode == 0 and read.stdout.split()[0] == digest, read.stderr

        done = user.dlfs("umount", str(mnt), env=env)
        assert done.returncode == 0, done.stderr
        assert ckpt_mounts(user.uid) == []
        assert str(mnt) not in mounts_by_path()

        # root unmounting the user's mount finds the checkpoint connection too
        mount()
        assert ckpt_mounts(user.uid) == outside
        done = run_dlfs("umount", mnt)
        assert done.returncode == 0, done.stderr
        assert ckpt_mounts(user.uid) == []
        assert str(mnt) not in mounts_by_path()

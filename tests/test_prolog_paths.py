"""Paths the Slurm prolog makes as root for a job: its checkpoint directory
(`dlfs slurm-ckpt-dir`, by descriptors) and the daemon's log and summary (0640).

What it replaces, `readlink -m` + `mkdir -p` + `chown` by path, let the job's user
plant a symlink at the name (or at a parent made for the job) and have root hand the
link's target to the user. Here: the directory comes out 0700 and the user's; a
symlink at the name or for a parent is refused with one line and its target keeps
its owner; a prefix or a directory owned by another user is refused; and a user
swapping the name for a link in a loop while root makes it never gets the chown
outside the prefix. Logs and summaries under /var/log/dlfs name users' paths: they
are made 0640 whatever the umask, a pre-existing log is narrowed to 0640, and a
symlink at the log's name is refused.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import DLFS, run_dlfs
from sysusers import temp_user

from dlfs.cluster.slurm import make_job_dir
from dlfs.errors import DlfsError

DLFS_BIN = DLFS[0]  # the venv's entry point, as dlfs.conf names it
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the prolog runs as root")


@pytest.fixture
def base():
    """A scratch dir the test users can enter (pytest's tmp_path is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="dlfs-ckdir-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_dir(pattern: str, user, job: str = "41", node: str = "n1"):
    return run_dlfs("slurm-ckpt-dir", pattern, "--job-id", job, "--node", node,
                    "--uid", str(user.uid), "--gid", str(user.gid))


def root_target(base: Path) -> Path:
    """A root-owned directory outside the prefix: what a planted link points at."""
    target = base / "root-only"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    return target


def untouched(target: Path) -> bool:
    st = target.stat()
    return (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o755) \
        and not any(target.iterdir())


def test_the_job_dir_is_made_0700_for_the_user(base):
    prefix = base / "ckpt"  # missing: the site's prefix is made (root's)
    with temp_user() as user:
        made = make_dir(f"{prefix}/%j/%n", user)
        assert made.returncode == 0, made.stderr
        assert made.stdout.strip() == str(prefix / "41" / "n1")
        for path in (prefix / "41", prefix / "41" / "n1"):
            st = path.lstat()
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, path
            assert (st.st_uid, st.st_gid) == (user.uid, user.gid), path
        assert prefix.stat().st_uid == 0
        again = make_dir(f"{prefix}/%j/%n", user)  # a requeued job: its own dir again
        assert again.returncode == 0, again.stderr


def test_a_symlink_at_the_name_or_for_a_parent_is_refused(base):
    target = root_target(base)
    with temp_user() as user:
        prefix = base / "users-own"  # a prefix the job's user may write to
        prefix.mkdir()
        os.chown(prefix, user.uid, user.gid)
        (prefix / "41").symlink_to(target)  # planted at the job's name
        planted = make_dir(f"{prefix}/%j", user)
        assert planted.returncode == 1
        assert planted.stderr.strip() == (
            f"dlfs: error: refusing the checkpoint dir {prefix / '41'}: a symlink or not a "
            "directory (remove it; the prolog makes it)")
        assert untouched(target)

        # A parent the job's first node made, swapped for a link before another node's
        # prolog makes its own directory inside.
        (prefix / "41").unlink()
        assert make_dir(f"{prefix}/%j/%n", user, node="n1").returncode == 0
        os.rename(prefix / "41", prefix / "41.old")
        (prefix / "41").symlink_to(target)
        swapped = make_dir(f"{prefix}/%j/%n", user, node="n2")
        assert swapped.returncode == 1 and "a symlink" in swapped.stderr
        assert untouched(target)


def test_another_users_prefix_or_dir_is_refused(base):
    with temp_user() as user, temp_user() as other:
        theirs = base / "theirs"
        theirs.mkdir()
        os.chown(theirs, other.uid, other.gid)
        refused = make_dir(f"{theirs}/%j", user)
        assert refused.returncode == 1
        assert f"its parent is owned by uid {other.uid}" in refused.stderr
        assert not (theirs / "41").exists()

        shared = base / "shared"
        shared.mkdir(mode=0o1777)
        shared.chmod(0o1777)
        (shared / "41").mkdir()
        os.chown(shared / "41", other.uid, other.gid)  # another user got there first
        taken = make_dir(f"{shared}/%j", user)
        assert taken.returncode == 1
        assert f"it is owned by uid {other.uid}" in taken.stderr
        assert (shared / "41").stat().st_uid == other.uid


def test_a_user_swapping_the_name_for_a_link_never_gets_the_chown_outside(base):
    """The user's own loop renames the job dir away and puts a link to a root-owned
    directory in its place, as fast as it can, while root makes the dir 300 times."""
    target = root_target(base)
    with temp_user() as user:
        prefix = base / "race"
        prefix.mkdir()
        os.chown(prefix, user.uid, user.gid)
        loop = (f"cd {prefix} || exit 1; i=0; while :; do i=$((i+1)); "
                f"mv -T 41 old$i 2>/dev/null; ln -sfn {target} 41 2>/dev/null; rm -f 41; done")
        # Its own process group: killing runuser alone would leave its bash looping.
        attacker = subprocess.Popen(["runuser", "-u", user.name, "--", "bash", "-c", loop],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        made = refused = 0
        try:
            time.sleep(0.2)
            deadline = time.monotonic() + 30
            for _ in range(300):
                try:
                    make_job_dir(f"{prefix}/%j", "41", "n1", user.uid, user.gid)
                    made += 1
                except DlfsError as err:
                    assert "refusing the checkpoint dir" in str(err), err
                    refused += 1
                assert untouched(target), "root's chown or mkdir landed outside the prefix"
                if time.monotonic() > deadline:
                    break
            assert attacker.poll() is None, "the user's loop stopped"
        finally:
            os.killpg(attacker.pid, signal.SIGKILL)
            attacker.wait()
        assert made + refused > 0 and untouched(target)


def test_logs_and_summaries_are_0640(mounted, store_with, base):
    src = base / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a" * 1000)
    store = store_with(src, "ds", "64K")
    logs = base / "log"
    logs.mkdir()
    log, summary = logs / "1-n1.log", logs / "1-n1.summary.json"
    log.write_text("an earlier line\n")
    log.chmod(0o644)  # a log made before, world-readable
    old = os.umask(0o022)
    try:
        m = mounted(store, "--log-file", str(log), "--summary-file", str(summary))
        assert run_dlfs("umount", m.path).returncode == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(log.stat().st_mode) == 0o640
    assert log.read_text().startswith("an earlier line\n")
    assert stat.S_IMODE(summary.stat().st_mode) == 0o640
    linked = logs / "2-n1.log"
    linked.symlink_to(base / "elsewhere.log")
    refused = mounted.try_mount(store, "--log-file", str(linked))
    assert refused.returncode == 1 and "it is a symlink" in refused.stderr, refused.stderr
    assert not (base / "elsewhere.log").exists()


def test_the_prolog_warns_about_a_shared_ckpt_dir_and_refuses_anothers(base):
    """The real prolog.sh, run as slurmd would (no Slurm needed: it fails before the
    mount): a DLFS_CKPT_STORE without %j gets a warning in the job's log, and the
    directory, already another user's, is refused in one line; nothing is left."""
    repo = Path(__file__).resolve().parent.parent
    site = base / "site"
    site.mkdir()
    for name in ("prolog.sh", "common.sh"):
        shutil.copy2(repo / "deploy" / "slurm" / name, site / name)
    key = site / "site.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    (base / "store").mkdir()
    with temp_user() as user, temp_user() as other:
        shared = base / "ckpt" / "shared"
        shared.mkdir(parents=True)
        os.chown(shared, other.uid, other.gid)
        conf = {"DLFS_BIN": DLFS_BIN, "DLFS_STORE": str(base / "store"),
                "DLFS_MOUNT": f"{base}/mnt/%j", "DLFS_CACHE": f"{base}/cache/%j",
                "DLFS_RUN_DIR": f"{base}/run/%j", "DLFS_LOG": f"{base}/log/%j-%n.log",
                "DLFS_SITE_KEY": str(key), "DLFS_PORT_BASE": "7000",
                "DLFS_NODE_HOST": "127.0.0.1", "DLFS_OPT_IN": "comment",
                "DLFS_MOUNT_ARGS": "", "DLFS_MOUNT_TIMEOUT": "10",
                "DLFS_CKPT_STORE": str(shared)}
        (site / "dlfs.conf").write_text("".join(f"{k}='{v}'\n" for k, v in conf.items()))
        env = {"SLURM_JOB_ID": "77", "SLURM_JOB_UID": str(user.uid),
               "SLURM_JOB_GID": str(user.gid), "SLURMD_NODENAME": "n1",
               "SLURM_JOB_COMMENT": "dlfs", "SLURM_NODELIST": "n1"}
        old = os.umask(0o022)
        try:
            ran = subprocess.run(["bash", str(site / "prolog.sh")], env=env,
                                 capture_output=True, text=True, timeout=60)
        finally:
            os.umask(old)
        assert ran.returncode == 1, ran.stdout + ran.stderr
        last = ran.stdout.strip().splitlines()[-1]
        assert last == (f"dlfs prolog: job 77 on n1: cannot create the checkpoint dir: dlfs: "
                        f"error: refusing the checkpoint dir {shared}: it is owned by uid "
                        f"{other.uid}, neither root nor the job's user {user.uid} (remove "
                        f"it, or fix DLFS_CKPT_STORE) (DLFS_CKPT_STORE in {site}/dlfs.conf)")
        log = base / "log" / "77-n1.log"
        warning = [ln for ln in log.read_text().splitlines() if "dlfs.prolog WARNING" in ln]
        assert len(warning) == 1 and f"DLFS_CKPT_STORE={shared} has no %j" in warning[0]
        assert stat.S_IMODE(log.stat().st_mode) == 0o640
        assert shared.stat().st_uid == other.uid
        for left in ("mnt/77", "cache/77", "run/77"):
            assert not (base / left).exists(), left

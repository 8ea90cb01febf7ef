"""A root daemon mounting for a user (`--uid`, the Slurm prolog) serves only the
datasets that user may read in the store (dlfsd.base.access).

Real root daemon, a throw-away user, a store under a 0755 directory in /tmp (pytest's
own tmp dirs are 0700, which no other user may enter) with one dataset the user may
read and one in a 0700 root directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import Mounter, populate_store
from sysusers import temp_user
from trees import make_small_tree

pytestmark = pytest.mark.usefixtures("daemon_guard")


@pytest.fixture(scope="module")
def store_and_base(tmp_path_factory):
    """(store, base): datasets "open" (0755) and "secret" (0700, root's) in a store
    under `base`, a 0755 directory in /tmp that also holds the mountpoints."""
    base = Path(tempfile.mkdtemp(prefix="dlfs-access-", dir="/tmp"))
    base.chmod(0o755)
    try:
        src = tmp_path_factory.mktemp("access") / "src"
        make_small_tree(src, files=4)
        store = base / "store"
        populate_store(src, store, "open")
        populate_store(src, store, "secret")
        for path in (store, store / "open"):
            path.chmod(0o755)
        (store / "secret").chmod(0o700)
        yield store, base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_dataset_the_user_may_not_read_is_not_served(store_and_base):
    store, base = store_and_base
    mounter = Mounter(base)
    try:
        with temp_user() as owner:
            user_args = ("--uid", str(owner.uid), "--gid", str(owner.gid), "--workers", "1")
            mount = mounter(store, *user_args)  # the whole store: "secret" left out
            mount.path.parent.chmod(0o755)
            assert sorted(os.listdir(mount.path)) == ["open"]
            listing = owner.run("ls", str(mount.path / "secret"))
            assert listing.returncode != 0 and "No such file" in listing.stderr
            assert owner.run("ls", str(mount.path / "open")).returncode == 0
            warnings = [ln for ln in mount.log_text().splitlines() if "not served" in ln]
            assert len(warnings) == 1 and "'secret'" in warnings[0], warnings
            assert f"user {owner.name} (uid {owner.uid}) may not read" in warnings[0]

            # Named explicitly: the mount fails with one line naming it.
            named = mounter.try_mount(store, "--dataset", "secret", *user_args)
            assert named.returncode != 0
            line = named.stderr.strip()
            assert "\n" not in line, named.stderr
            assert "may not read dataset 'secret'" in line and "Permission denied" in line
            assert "leave it out of --dataset" in line
            assert not [mp for mp in mounter.mountpoints[1:] if os.path.ismount(mp)]

            # Root's own mount (no --uid) still serves everything.
            everything = mounter(store, "--workers", "1")
            assert sorted(os.listdir(everything.path)) == ["open", "secret"]
    finally:
        mounter.cleanup()

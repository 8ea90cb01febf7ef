"""One release per node: `dlfs --version` names the daemon's too, and a mount refuses a
daemon of another release in one line (a node whose /opt/dlfs mixes two installs).

The daemons of another release are real: a copy of this checkout's daemon package
with another `__version__`, or an unversioned one from before the check, put first
on PYTHONPATH, where `python -m dlfsd` finds it as it would a stale install.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path

import pytest
from conftest import fstype_at, run_dlfs

import dlfs
import dlfsd

pytestmark = pytest.mark.usefixtures("daemon_guard")

OTHER = "0.0.1"


def daemon_of_release(where: Path, version: str) -> dict[str, str]:
    """A copy of the real daemon package reporting `version`; the env that runs it."""
    package = where / "dlfsd"
    shutil.copytree(Path(dlfsd.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = package / "__init__.py"
    text = init.read_text()
    assert f'__version__ = "{dlfsd.__version__}"' in text
    init.write_text(text.replace(f'__version__ = "{dlfsd.__version__}"',
                                 f'__version__ = "{version}"'))
    return {"PYTHONPATH": str(where)}


def test_one_release_names_one_version_everywhere():
    assert dlfsd.__version__ == dlfs.__version__ == importlib.metadata.version("dlfs")


def test_version_names_the_daemon_as_mount_would_start_it(tmp_path):
    done = run_dlfs("--version")
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first.startswith(f"dlfs {dlfs.__version__} (")
    assert second == f"dlfsd {dlfsd.__version__} ({Path(dlfsd.__file__).parent.resolve()})"

    env = daemon_of_release(tmp_path, OTHER)
    done = run_dlfs("--version", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == (
        f"dlfsd {OTHER} ({tmp_path.resolve() / 'dlfsd'}) -- not dlfs {dlfs.__version__}: "
        "mounts refuse it")


def test_version_says_when_the_daemon_cannot_start(tmp_path):
    (tmp_path / "dlfsd").mkdir()
    (tmp_path / "dlfsd" / "__init__.py").write_text("import dlfsd.missing_part\n")
    done = run_dlfs("--version", env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[1]
    assert line.startswith("dlfsd: cannot start (`") and "exited 1: " in line
    assert "No module named 'dlfsd.missing_part'" in line


@pytest.mark.parametrize("how", ["background", "foreground"])
def test_a_mount_refuses_a_daemon_of_another_release(store_with, mounted, tmp_path, how):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 1000)
    store = store_with(src)
    env = daemon_of_release(tmp_path / "old", OTHER)
    mp = mounted.new_mountpoint()
    args = ["--foreground"] if how == "foreground" else []
    done = mounted.try_mount(store, *args, mountpoint=mp, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert (f"is dlfsd {OTHER} but dlfs is {dlfs.__version__}" in done.stderr
            and str(tmp_path.resolve() / "old" / "dlfsd") in done.stderr), done.stderr
    assert fstype_at(os.path.realpath(mp)) is None

    ok = mounted.try_mount(store, mountpoint=mp)  # this release's own daemon mounts
    assert ok.returncode == 0, ok.stderr
    assert (mp / "ds" / "f").read_bytes() == b"x" * 1000


def test_a_mount_explains_an_unversioned_daemon(store_with, mounted, tmp_path):
    """A dlfsd from before the check knows no --launcher-version: its argparse exits 2."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"y")
    store = store_with(src)
    old = tmp_path / "old" / "dlfsd"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("")
    (old / "__main__.py").write_text(
        "import argparse\n"
        "parser = argparse.ArgumentParser(prog='dlfsd')\n"
        "parser.add_argument('--config', required=True)\n"
        "parser.parse_args()\n")
    done = mounted.try_mount(store, env={"PYTHONPATH": str(old.parent)})
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"refused the command line of dlfs {dlfs.__version__}" in done.stderr

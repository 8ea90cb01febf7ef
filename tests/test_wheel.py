"""The release as a site installs it: the wheel, in a fresh venv, away from the checkout.

Every other test runs the editable install, which finds any module of the
checkout whether the wheel holds it or not: a wheel without `dlfsd.ckpt` once
populated fine and could not mount. Here the wheel is built (with build
isolation, from a copy of the checkout), installed with its dependencies by the
new venv's own pip (which may take them from the pip cache or a registry), and
run from a directory outside the checkout with no PYTHONPATH: populate, mount
with a checkpoint store, a byte-exact read, a checkpoint written and flushed,
status, umount. The mount is torn down even when a step fails (conftest's
Mounter, which adopts it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import daemon_pids_for, fstype_at, require_fuse

from dlfs import __version__

pytestmark = pytest.mark.usefixtures("daemon_guard")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"dlfs": "dlfs", "daemon": "dlfsd"}  # checkout directory -> package
# Not part of a release: what a checkout accumulates beside its sources.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".ruff_cache",
                                     ".hypothesis", "bench-out")


def _run(argv: list[str | os.PathLike], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, (f"`{' '.join(map(str, argv))}` exited {done.returncode}\n"
                                  f"{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of this checkout (a build in place
    would leave build/ behind, whose stale files a later wheel picks up)."""
    where = tmp_path_factory.mktemp("wheel")
    source = where / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES, symlinks=True)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", where / "dist",
          source], cwd=where)
    [built] = (where / "dist").glob("dlfs-*.whl")
    return built


def test_the_wheel_holds_every_module_of_the_checkout(wheel):
    with zipfile.ZipFile(wheel) as z:
        held = {name for name in z.namelist() if name.endswith(".py")}
    wanted = {
        f"{package}/{path.relative_to(ROOT / directory).as_posix()}"
        for directory, package in PACKAGE_DIRS.items()
        for path in (ROOT / directory).rglob("*.py") if "__pycache__" not in path.parts
    }
    assert len(wanted) > 100
    assert sorted(wanted - held) == []


def test_the_installed_wheel_mounts_reads_and_keeps_a_checkpoint(wheel, tmp_path, mounted):
    require_fuse()
    venv, away = tmp_path / "venv", tmp_path / "elsewhere"
    away.mkdir()
    _run([sys.executable, "-m", "venv", venv], cwd=away)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "DLFS_READY_FD")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    _run([venv / "bin" / "pip", "install", "-q", wheel], cwd=away, env=env)
    dlfs = venv / "bin" / "dlfs"

    def run(*args: str | os.PathLike) -> subprocess.CompletedProcess:
        return _run([dlfs, *args], cwd=away, env=env, timeout=120)

    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
        / "site-packages"
    assert run("--version").stdout.splitlines() == [  # the daemon imports whole, too
        f"dlfs {__version__} ({site / 'dlfs'})", f"dlfsd {__version__} ({site / 'dlfsd'})"]

    src = tmp_path / "src"
    (src / "train" / "cats").mkdir(parents=True)
    samples = {f"train/cats/{i}.jpg": os.urandom(1000 + 7919 * i) for i in range(20)}
    samples["labels.txt"] = b"cat\n" * 100
    for name, data in samples.items():
        (src / name).write_bytes(data)
    store, ckstore = tmp_path / "store", tmp_path / "ckstore"
    run("populate", src, "--store", store, "--name", "ds", "--chunk-size", "64K")

    mp = mounted.adopt(mounted.new_mountpoint())
    run("mount", mp, "--store", store, "--cache-dir", tmp_path / "cache", "--ckpt-store",
        ckstore, "--log-file", tmp_path / "dlfsd.log", "--timeout", "60")
    assert fstype_at(os.path.realpath(mp)) == "fuse.dlfs"
    for name, data in samples.items():
        assert (mp / "ds" / name).read_bytes() == data, name

    model = os.urandom(3 << 20)
    (mp / "ckpt" / "step-1").mkdir()
    (mp / "ckpt" / "step-1" / "model.pt").write_bytes(model)
    assert "flushed" in run("flush", mp).stdout
    stored = (ckstore / "step-1" / "model.pt").read_bytes()
    assert hashlib.sha256(stored).digest() == hashlib.sha256(model).digest()

    status = run("status", mp).stdout
    assert "ds" in status, status
    run("umount", mp)
    assert fstype_at(os.path.realpath(mp)) is None
    assert daemon_pids_for(os.path.realpath(mp)) == []

"""Throw-away system users for tests that check what another user can (not) see."""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def run(self, *argv: str, timeout: float = 30,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run argv as this user (runuser, no login shell); `env`: variables added."""
        extra = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        return subprocess.run(["runuser", "-u", self.name, "--", *extra, *argv],
                              capture_output=True, text=True, timeout=timeout)

    def dlfs(self, *args: str, timeout: float = 60,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run the `dlfs` CLI as this user: a real process with the user's uid and no
        capabilities. The venv's interpreter may sit in a directory only root may enter
        (/root/.pyenv): run a system Python of the same version instead, with a copy of
        what dlfs imports that the user can read added as a site directory
        (readable_site)."""
        python = user_python(self)
        code = (f"import site, sys; site.addsitedir({str(readable_site())!r}); "
                "from dlfs.cli.main import main; sys.argv[0] = 'dlfs'; sys.exit(main())")
        return self.run(python, "-c", code, *args, timeout=timeout, env=env)


def site_env(directory: Path) -> dict[str, str]:
    """Environment under which a Python that `User.dlfs` runs passes readable_site on
    to the Pythons it starts itself (the daemon: `python -m dlfsd`): a sitecustomize
    in `directory` (which the user must be able to read) adds it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        f"import site; site.addsitedir({str(readable_site())!r})\n")
    directory.chmod(0o755)
    return {"PYTHONPATH": str(directory)}


_SITE: list[Path] = []


def readable_site() -> Path:
    """A directory every user can read that holds what `dlfs` and its daemon import:
    the dlfs and dlfsd packages this test process imports (the checkout's, for an
    editable install) and the installed distributions dlfs requires, file by file
    as their RECORD lists them. Made once per session in /tmp, removed at exit.

    Why a copy: the venv and the checkout may lie where only root may enter (a
    checkout in root's 0700 home, as in a fresh container), and a test's user must
    run the same code the suite tests, not whatever its own Python finds. /tmp and
    not $TMPDIR: `dev.sh test-overlay` puts $TMPDIR under a directory only root may
    enter."""
    if _SITE:
        return _SITE[0]
    import dlfs
    import dlfsd

    site = Path(tempfile.mkdtemp(prefix="dlfs-usersite-", dir="/tmp"))
    atexit.register(shutil.rmtree, site, True)
    _SITE.append(site)
    skip = shutil.ignore_patterns("__pycache__")
    for package in (dlfs, dlfsd):
        shutil.copytree(Path(package.__file__).parent, site / package.__name__, ignore=skip)
    for dist in _required_distributions("dlfs"):
        for file in dist.files or ():
            if file.parts[0] == ".." or "__pycache__" in file.parts:
                continue  # scripts in bin/; bytecode is rebuilt
            source = Path(dist.locate_file(file))
            if source.is_file():
                (site / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, site / file)
    for directory, dirs, files in os.walk(site):  # whatever root's umask said
        for name in dirs:
            os.chmod(os.path.join(directory, name), 0o755)
        for name in files:
            path = os.path.join(directory, name)
            os.chmod(path, os.stat(path).st_mode | 0o444)
    site.chmod(0o755)
    return site


def _required_distributions(name: str) -> list[importlib.metadata.Distribution]:
    """The installed distributions that `name` requires, directly or not (no extras;
    a requirement whose marker excludes this Python is simply not installed)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        try:
            dist = importlib.metadata.distribution(todo.pop())
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in dist.requires or ():
            spec, _, marker = requirement.partition(";")
            wanted = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
            key = wanted and re.sub(r"[-_.]+", "-", wanted[1]).lower()
            if key and "extra" not in marker and key not in found:
                found[key] = None  # type: ignore[assignment]  # claimed: visit once
                todo.append(key)
        if dist.metadata["Name"].lower() != name:
            found[re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()] = dist
    return [dist for dist in found.values() if dist is not None]


_PYTHONS: dict[str, str] = {}


def user_python(user: User) -> str:
    """A Python of this interpreter's major.minor that `user` can run (skip if none)."""
    if "found" not in _PYTHONS:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        for candidate in (sys.executable, f"/usr/bin/python{version}",
                          f"/usr/local/bin/python{version}"):
            probe = user.run(candidate, "-c", "import sys; print(sys.version_info[:2])")
            if probe.returncode == 0 and probe.stdout.strip() == str(sys.version_info[:2]):
                _PYTHONS["found"] = candidate
                break
        else:
            pytest.skip(f"no Python {version} an unprivileged user can run (this one, "
                        f"{sys.executable}, is out of its reach)")
    return _PYTHONS["found"]


def require_useradd() -> None:
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("needs root with useradd and runuser to create a test user")


@contextlib.contextmanager
def temp_user(prefix: str = "dlfst") -> Iterator[User]:
    """A new user with its own group and no home; removed afterwards, also on failure."""
    require_useradd()
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/bin/sh", name],
                   check=True, capture_output=True)
    uid = None
    try:
        entry = pwd.getpwnam(name)
        uid = entry.pw_uid
        yield User(name, entry.pw_uid, entry.pw_gid)
    finally:
        if uid is not None:  # the runtime dir its `dlfs` runs made (dlfs.runtime)
            shutil.rmtree(f"/tmp/dlfs-{uid}", ignore_errors=True)
        subprocess.run(["userdel", name], capture_output=True)

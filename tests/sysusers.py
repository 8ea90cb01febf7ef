"""Throw-away system users for tests that check what another user can (not) see."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
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
        (/root/.pyenv): run a system Python of the same version instead, with the
        venv's packages (the editable dlfs among them) added as a site directory."""
        python = user_python(self)
        code = (f"import site, sys; site.addsitedir({sysconfig.get_paths()['purelib']!r}); "
                "from dlfs.cli.main import main; sys.argv[0] = 'dlfs'; sys.exit(main())")
        return self.run(python, "-c", code, *args, timeout=timeout, env=env)


def site_env(directory: Path) -> dict[str, str]:
    """Environment under which a Python that `User.dlfs` runs passes the venv's
    packages on to the Pythons it starts itself (the daemon: `python -m dlfsd`): a
    sitecustomize in `directory` (which the user must be able to read) adds them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    directory.chmod(0o755)
    return {"PYTHONPATH": str(directory)}


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

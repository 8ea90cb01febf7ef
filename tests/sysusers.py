"""Throw-away system users for tests that check what another user can (not) see."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run argv as this user (runuser, no login shell)."""
        return subprocess.run(["runuser", "-u", self.name, "--", *argv], capture_output=True,
                              text=True, timeout=timeout)


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
    try:
        entry = pwd.getpwnam(name)
        yield User(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)

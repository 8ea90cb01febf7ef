"""Finds the packages for setuptools (the rest of the build is in pyproject.toml).

Listing packages by hand lost `dlfsd.ckpt` and `dlfs.order` from the wheel while
every editable install still worked. `[tool.setuptools.packages.find]` cannot
find them either: the daemon's package `dlfsd` lives in the directory daemon/,
and `find` names a package after its directory. So both trees are walked here
and the daemon's subpackages renamed; tests/test_wheel.py checks the result.
"""

from setuptools import find_packages, setup

DAEMON_DIR, DAEMON_PACKAGE = "daemon", "dlfsd"

packages = find_packages(include=["dlfs", "dlfs.*"]) + [DAEMON_PACKAGE] + [
    f"{DAEMON_PACKAGE}.{sub}" for sub in find_packages(where=DAEMON_DIR)]

setup(packages=packages)

"""Which of this node's live mounts serve a dataset (`dlfs rm` refuses to remove one).

Found from the process table (dlfs.procs: every background daemon's MountConfig)
and from the status files of foreground daemons in our runtime directory.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from dlfs.procs import daemon_configs, parent_pid, pid_alive, start_time
from dlfs.runtime import runtime_dir, status_path
from dlfs.store.format import MANIFEST_NAME

STATUS_FRESH = 30.0  # seconds: a live daemon rewrites its status file every second


def mounts_using(store: Path, name: str) -> list[tuple[str, int]]:
    """(mountpoint, daemon pid) of this node's live mounts serving dataset `name` of
    `store` (compared as directories: a dataset linked into another store counts):
    every background daemon's (from the process table: any user's, unless /proc is
    mounted hidepid), and the foreground ones of our runtime directory (from their
    status files). Other nodes' mounts of a shared store are out of sight."""
    target = store / name
    found: dict[str, int] = {}
    for pid, config in daemon_configs():
        mountpoint, served_store = str(config.get("mountpoint")), config.get("store")
        if not isinstance(served_store, str):
            continue
        names = config.get("datasets") or _served(mountpoint, pid) \
            or _published_before(Path(served_store), pid)
        if any(_same_dir(os.path.join(served_store, n), target) for n in names):
            found.setdefault(mountpoint, pid)
    for path in runtime_dir().glob("*.status.json"):
        try:
            status = json.loads(path.read_text())
            pid, names = int(status["pid"]), [d["name"] for d in status["datasets"]]
            fresh = time.time() - float(status["updated"]) < STATUS_FRESH
            served_store = str(status["store"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if fresh and _is_dlfs(pid) and any(
                _same_dir(os.path.join(served_store, n), target) for n in names):
            found.setdefault(str(status.get("mountpoint")), pid)
    return sorted(found.items())


def _served(mountpoint: str, pid: int) -> list[str]:
    """The datasets a daemon mounted "all datasets" of its store serves (those there at
    mount time), from its status file; [] if that is not ours to read."""
    try:
        status = json.loads(status_path(mountpoint).read_text())
        parent = parent_pid(pid)
        if int(status["pid"]) in (pid, parent):  # `pid` may be one of its workers
            return [d["name"] for d in status["datasets"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return []


def _published_before(store: Path, pid: int) -> list[str]:
    """For another user's "all datasets" mount (its status file is not ours to read):
    the store's datasets published before its daemon started, the ones it loaded."""
    started = _started_at(pid)
    try:
        entries = list(os.scandir(store))
    except OSError:
        return []
    names = []
    for entry in entries:
        try:
            if os.stat(os.path.join(entry.path, MANIFEST_NAME)).st_mtime <= started:
                names.append(entry.name)
        except OSError:
            continue
    return names


def _started_at(pid: int) -> float:
    """Wall-clock time process `pid` started (+inf if unknown: then every dataset counts)."""
    try:
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return math.inf
    ticks = start_time(pid)
    return boot + ticks / os.sysconf("SC_CLK_TCK") + 1.0 if ticks else math.inf


def _same_dir(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_dlfs(pid: int) -> bool:
    """A live process running dlfs (not another one that got a dead daemon's pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dlfs" in f.read() and pid_alive(pid)
    except OSError:
        return False

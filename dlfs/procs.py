"""Processes, as /proc shows them: alive or not, when started, in which session, whose;
and which of them are DLFS daemons (their command line carries a MountConfig).

Read only, never signalled here: `dlfs umount` and `dlfs status` decide what to do
with what this finds (dlfs.runtime ties a runtime record to its processes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from dlfs.launch import config_in_argv


def start_time(pid: int) -> int:
    """When process `pid` started (clock ticks since boot; /proc/PID/stat field 22), 0 if
    it does not exist."""
    fields = _stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else 0


def parent_pid(pid: int) -> int:
    """Process `pid`'s parent (/proc/PID/stat field 4), 0 if it is gone."""
    fields = _stat_fields(pid)
    return int(fields[1]) if len(fields) > 1 else 0


def serving_daemon(mountpoint: str) -> int | None:
    """The pid of a live `dlfsd` whose mountpoint is `mountpoint` (canonical), found from
    the process table, not from a record (one kept in another runtime directory, or one
    logind removed at logout, is not ours to see)."""
    for pid, config in daemon_configs():
        if config.get("mountpoint") == mountpoint:
            return pid
    return None


def daemon_configs() -> Iterator[tuple[int, dict]]:
    """(pid, MountConfig as a dict) of every live `dlfsd` process (workers too)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        raw = config_in_argv(argv)
        if raw is None:
            continue
        try:
            config = json.loads(raw)
        except ValueError:
            continue
        if isinstance(config, dict) and pid_alive(int(entry.name)):
            yield int(entry.name), config


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def session_of(pid: int) -> int | None:
    """Process `pid`'s session id (/proc/PID/stat field 6), None if it is gone."""
    fields = _stat_fields(pid)
    return int(fields[3]) if len(fields) > 3 else None


def all_uids_ours(pid: int) -> bool:
    """Every uid of `pid` (real, effective, saved, fs) is ours: not a setuid program a
    user started (its real uid is the user's), not a user's process."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            line = next(row for row in f if row.startswith(b"Uid:"))
    except (OSError, StopIteration):
        return False
    return all(int(uid) == os.geteuid() for uid in line.split()[1:])


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a dead, unreaped daemon)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in (b"Z", b"X")


def _stat_fields(pid: int) -> list[bytes]:
    """/proc/PID/stat from field 3 (state) on, [] if there is no such process. Split
    after the last ')': the command name in field 2 may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return []

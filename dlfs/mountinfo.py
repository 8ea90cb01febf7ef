"""What the kernel says is mounted where (/proc/self/mountinfo), without touching mounts.

Reading mountinfo never blocks on a hung or dead FUSE daemon, unlike a stat
of the mountpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: MOUNTPOINT/ckpt, the checkpoint directory: a FUSE connection of its own, mounted on
#: the DLFS mount by the same daemon (dlfsd.fuse.rawsession); unmounted before it.
CKPT_FSTYPE = "fuse.dlfs-ckpt"
CKPT_DIR = "ckpt"


@dataclass(frozen=True)
class MountEntry:
    device: str  # "major:minor", also the name of the mount's /sys/class/bdi entry
    fstype: str  # e.g. "fuse.dlfs"


def find_mount(mountpoint: str) -> MountEntry | None:
    """The top mount at canonical path `mountpoint`, or None."""
    found = None
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            left, _, right = line.partition(b" - ")
            fields = left.split()
            if _unescape(fields[4]) == mountpoint:
                found = MountEntry(fields[2].decode(), right.split()[0].decode())
    return found


def mountpoints_of_type(fstype: str) -> list[str]:
    """Every mountpoint whose file system type is `fstype` (e.g. "fuse.dlfs")."""
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            left, _, right = line.partition(b" - ")
            if right.split()[0].decode() == fstype:
                found.append(_unescape(left.split()[4]))
    return found


def _unescape(raw: bytes) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as \\ooo."""
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] == 0x5C and i + 3 < len(raw) and raw[i + 1 : i + 4].isdigit():
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return os.fsdecode(bytes(out))

"""What the running kernel's FUSE does: which answers it takes as "never ask again".

Both the FUSE adapter (whether a worker answers OPEN/OPENDIR) and the
observability core (whether opens can be counted) need to know, so the
knowledge lives below both.
"""

from __future__ import annotations

import os

# Kernels from which an ENOSYS answer to OPEN / OPENDIR means "never ask again"
# (no_open / no_opendir); before them the application would get the ENOSYS.
# FUSE protocol 7.23 (Linux 3.15) added FUSE_NO_OPEN_SUPPORT, 7.29 (5.1) no_opendir.
NO_OPEN_SINCE = (3, 15)
NO_OPENDIR_SINCE = (5, 1)
KERNEL_RELEASE_VAR = "DLFSD_KERNEL_RELEASE"  # stands in for uname's release (tests)
# Seconds the kernel may take to send FUSE INIT after a mount (either connection).
INIT_TIMEOUT = 60.0


def kernel_version(release: str) -> tuple[int, int]:
    """(major, minor) of a kernel release string such as '4.18.0-553.el8_10.x86_64';
    (0, 0) if it does not start with numbers, which makes every feature check fail safe."""
    numbers = []
    for part in release.split(".")[:2]:
        digits = len(part) - len(part.lstrip("0123456789"))
        if not digits:
            break
        numbers.append(int(part[:digits]))
    return (numbers[0], numbers[1]) if len(numbers) == 2 else (0, 0)


def kernel_release() -> str:
    return os.environ.get(KERNEL_RELEASE_VAR) or os.uname().release


def kernel_skips_opens(release: str | None = None) -> tuple[bool, bool]:
    """(no_open, no_opendir): whether this kernel stops sending OPEN / OPENDIR once
    answered ENOSYS. Distribution kernels may have them backported; then we answer
    opens we need not, which costs a round trip per open, never a failed open."""
    version = kernel_version(kernel_release() if release is None else release)
    return version >= NO_OPEN_SINCE, version >= NO_OPENDIR_SINCE


def workers_answer_opens(count_opens: bool) -> bool:
    """Whether worker processes answer OPEN (and so see, and count, every open): when
    asked to count them, or when this kernel would hand our ENOSYS to the application."""
    return count_opens or not kernel_skips_opens()[0]

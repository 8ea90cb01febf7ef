"""How large a pipe this process may make: what spliced FUSE read replies need.

The daemon's splicer (dlfsd.fuse.splicer) asks it once before its workers
fork, `dlfs doctor` asks it to warn early, the benchmarks to say what they
measured; so the probe lives here, below all three.
"""

from __future__ import annotations

import fcntl
import os

#: Room for a 1 MiB read (the largest FUSE read libfuse negotiates) plus the header;
#: a page per pipe slot, and the header takes one slot of its own.
PIPE_BYTES = 2 << 20
_HAVE_SPLICE = hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")


def _pipe_max_size() -> int:
    """The largest pipe an unprivileged process may ask for (default 1 MiB)."""
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def usable_pipe_size() -> int:
    """PIPE_BYTES if this process may make a pipe that large, else 0 (no splicing).

    Asked of a scratch pipe once, before workers fork, so the mount logs the
    outcome once. Only 1 MiB reads are worth splicing (see dlfsd.core.reader.SPAN_MIN),
    and they need the whole PIPE_BYTES.
    """
    if not _HAVE_SPLICE:
        return 0
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        return fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # EPERM above pipe-max-size without CAP_SYS_RESOURCE
        return 0
    finally:
        os.close(read_end)
        os.close(write_end)


def describe_pipe_size(size: int) -> str:
    """One log line: what splicing can do here, given usable_pipe_size()."""
    if size >= PIPE_BYTES:
        return f"1 MiB read replies spliced from chunk files (reply pipe {size >> 10} KiB)"
    if not _HAVE_SPLICE:
        return "read replies copied: splice(2) is not available"
    return (f"1 MiB read replies copied, not spliced: pipes are limited to "
            f"{_pipe_max_size() >> 10} KiB (fs.pipe-max-size, no CAP_SYS_RESOURCE); "
            f"`sysctl fs.pipe-max-size={PIPE_BYTES}` lifts it")

"""The contract between `dlfs mount` (the launcher) and the daemon it starts.

Both sides import it; neither imports the other's code for it. The launcher
runs `python -m dlfsd --config JSON` in a session of its own with a pipe in
$DLFS_READY_FD, on which the daemon writes one line: READY once the kernel
mount exists, or `ERROR <one line>`. An all-or-nothing launch (`mount --mpi`)
also passes the read end of a second pipe in $DLFS_COMMIT_FD: the daemon keeps
its mount only once COMMIT arrives there (dlfsd.commit). Finding a node's
daemons by their command line (dlfs.runtime, deploy/slurm/common.sh's
`pgrep -f -- '-m dlfsd --config'`) relies on this argv too.
"""

from __future__ import annotations

import sys

DAEMON_MODULE = "dlfsd"
CONFIG_FLAG = "--config"
READY_FD_ENV = "DLFS_READY_FD"  # the daemon's end of the readiness pipe
COMMIT_FD_ENV = "DLFS_COMMIT_FD"  # the daemon's end of a mount_uncommitted pipe
READY = "READY"  # the daemon is mounted
ERROR_PREFIX = "ERROR "  # the daemon cannot come up; the rest of the line says why
COMMIT = b"COMMIT\n"  # what keeps an uncommitted mount


def daemon_argv(config_json: str) -> list[str]:
    """The command line that starts a daemon for a MountConfig (as JSON)."""
    return [sys.executable, "-m", DAEMON_MODULE, CONFIG_FLAG, config_json]


def config_in_argv(argv: list[bytes]) -> bytes | None:
    """The --config JSON of a daemon's /proc/PID/cmdline fields, None if it is no daemon."""
    if DAEMON_MODULE.encode() not in argv or CONFIG_FLAG.encode() not in argv:
        return None
    at = argv.index(CONFIG_FLAG.encode()) + 1
    return argv[at] if at < len(argv) else None

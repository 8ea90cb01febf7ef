"""The contract between `dlfs mount` (the launcher) and the daemon it starts.

Both sides import it; neither imports the other's code for it. The launcher
runs `python -m dlfsd --config JSON` in a session of its own with a pipe in
$DLFS_READY_FD, on which the daemon writes one line: READY once the kernel
mount exists, or `ERROR <one line>`. An all-or-nothing launch (`mount --mpi`)
also passes the read end of a second pipe in $DLFS_COMMIT_FD: the daemon keeps
its mount only once COMMIT arrives there (dlfsd.commit). Finding a node's
daemons by their command line (dlfs.procs, deploy/slurm/common.sh's
`pgrep -f -- '-m dlfsd --config'`) relies on this argv too.

The launcher's version follows the config (`--launcher-version`): a daemon of
another version (a node whose install mixes two releases) refuses to mount with
one ERROR line (version_refusal) instead of failing somewhere inside.
"""

from __future__ import annotations

import subprocess
import sys

from dlfs import __version__

DAEMON_MODULE = "dlfsd"
CONFIG_FLAG = "--config"
VERSION_FLAG = "--launcher-version"  # after the config: `-m dlfsd --config` stays as it was
READY_FD_ENV = "DLFS_READY_FD"  # the daemon's end of the readiness pipe
COMMIT_FD_ENV = "DLFS_COMMIT_FD"  # the daemon's end of a mount_uncommitted pipe
READY = "READY"  # the daemon is mounted
ERROR_PREFIX = "ERROR "  # the daemon cannot come up; the rest of the line says why
COMMIT = b"COMMIT\n"  # what keeps an uncommitted mount


def daemon_argv(config_json: str) -> list[str]:
    """The command line that starts a daemon for a MountConfig (as JSON)."""
    return [sys.executable, "-m", DAEMON_MODULE, CONFIG_FLAG, config_json,
            VERSION_FLAG, __version__]


def version_refusal(daemon_version: str | None, daemon_dir: str,
                    launcher_version: str = __version__) -> str | None:
    """None where a daemon of `daemon_version` (None: one too old to have a version)
    may serve a launcher of `launcher_version`; else the one line that says why not.
    Only equal versions may: the config, the readiness pipe and the control sockets
    change between releases without a compatibility layer."""
    if daemon_version == launcher_version:
        return None
    return (f"the daemon in {daemon_dir} is dlfsd {daemon_version or '(unversioned, older)'} "
            f"but dlfs is {launcher_version}: install one release of both for "
            f"{sys.executable} (pip install --force-reinstall dlfs=={launcher_version})")


def daemon_version_line(timeout: float = 60.0) -> str:
    """What `python -m dlfsd --version` says, as `dlfs mount` would start it (same
    interpreter, same environment), or why it cannot start: for `dlfs --version`."""
    argv = [sys.executable, "-m", DAEMON_MODULE, "--version"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"dlfsd: cannot run `{' '.join(argv)}`: {err}"
    if done.returncode != 0 or not done.stdout.startswith("dlfsd "):
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"dlfsd: cannot start (`{' '.join(argv)}` exited {done.returncode}: {last})"
    line = done.stdout.strip()
    version = line.split()[1]
    if version != __version__:
        line += f" -- not dlfs {__version__}: mounts refuse it"
    return line


def config_in_argv(argv: list[bytes]) -> bytes | None:
    """The --config JSON of a daemon's /proc/PID/cmdline fields, None if it is no daemon."""
    if DAEMON_MODULE.encode() not in argv or CONFIG_FLAG.encode() not in argv:
        return None
    at = argv.index(CONFIG_FLAG.encode()) + 1
    return argv[at] if at < len(argv) else None

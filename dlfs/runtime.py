"""Where a running daemon leaves its pid and log, so `dlfs umount` can find it.

One small JSON record per mountpoint, keyed by a hash of the mountpoint's real
path, in a per-user runtime directory. Nothing in it is needed to serve reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from dlfs.errors import DlfsError
from dlfs.procs import all_pids, all_uids_ours, pid_alive, serving_daemon, session_of, start_time


def runtime_dir() -> Path:
    """/run/dlfs for root, $XDG_RUNTIME_DIR/dlfs, else /tmp/dlfs-UID; created 0700."""
    if os.geteuid() == 0 and os.access("/run", os.W_OK):
        base = Path("/run/dlfs")
    elif os.environ.get("XDG_RUNTIME_DIR"):
        base = Path(os.environ["XDG_RUNTIME_DIR"]) / "dlfs"
    else:
        base = Path(f"/tmp/dlfs-{os.geteuid()}")
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(base)
    return base


def _check_private(path: Path) -> None:
    """Records name pids `dlfs umount` signals, and logs are appended to: a directory
    someone else made first (in /tmp anyone can) must not be trusted."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise DlfsError(f"runtime directory {path} is not a directory of yours: remove it, "
                        "or set XDG_RUNTIME_DIR")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)


@dataclass
class DaemonRecord:
    pid: int
    mountpoint: str
    store: str
    log_file: str | None
    started: int = 0  # the pid's start time (start_time): tells a reused pid apart

    def alive(self) -> bool:
        """The daemon that wrote this record still runs (not just some process with its
        pid: after a SIGKILL the record stays, and the pid can be reused)."""
        return pid_alive(self.pid) and (not self.started or start_time(self.pid) == self.started)

    def how_it_died(self) -> str:
        """For `dlfs status` and `dlfs umount` of a daemon that is not alive but left its
        record (so it had no chance to clean up): the likely causes and where to look."""
        where = f"see its log {self.log_file}" if self.log_file else "it kept no log file"
        return f"killed (SIGKILL, the OOM killer) or crashed without unmounting; {where}"


def mountpoint_path(mountpoint: str) -> str:
    """Canonical path of a mountpoint, for the CLI, touching the mount as little as possible.

    The parent is fully resolved; the last component only when it is itself a
    symlink (lstat of a live mountpoint is answered from the kernel's attribute
    cache, of a dead one with ENOTCONN, so neither blocks). The daemon never
    calls this: it receives the canonical path and must not stat its own
    mountpoint before its FUSE loop runs.
    """
    # Not abspath: it drops "link/.." before the link is followed, so "x/link/../mnt"
    # would name x/mnt where the kernel (and `dlfs mount`) go to the link's parent.
    path = os.path.join(os.getcwd(), mountpoint).rstrip("/") or "/"
    parent, name = os.path.split(path)
    if name in ("", ".", ".."):
        return os.path.realpath(path)
    path = os.path.join(os.path.realpath(parent), name)
    if os.path.islink(path):
        path = os.path.realpath(path)
    return path


def _key(mountpoint: str) -> str:
    """Record key of a canonical mountpoint path (see mountpoint_path)."""
    return hashlib.sha1(os.fsencode(mountpoint)).hexdigest()[:16]  # any bytes a path holds


def mountpoint_key(mountpoint: str) -> str:
    """A short name for canonical mountpoint path `mountpoint` (see mountpoint_path).
    Touches nothing: a daemon may use it on its own mountpoint."""
    return _key(mountpoint)


def record_path(mountpoint: str) -> Path:
    return runtime_dir() / f"{_key(mountpoint)}.json"


def lock_path(mountpoint: str) -> Path:
    """Held by a `dlfs mount` of the mountpoint until it answers (see dlfs.cli.mountctl)."""
    return runtime_dir() / f"{_key(mountpoint)}.lock"


def status_path(mountpoint: str) -> Path:
    """Where the daemon of a mountpoint keeps its live status (for `dlfs status`)."""
    return runtime_dir() / f"{_key(mountpoint)}.status.json"


def ckpt_mount_path(mountpoint: str) -> Path:
    """Where a daemon that is not root mounts the checkpoint connection of `mountpoint`;
    MOUNTPOINT/ckpt is then a symlink to it. fusermount3 (setuid root) may not look
    inside another user's FUSE mount (the kernel lets only the mount's owner in, root
    not included, without allow_other), so it cannot mount on MOUNTPOINT/ckpt."""
    return runtime_dir() / ckpt_mount_name(mountpoint)


def ckpt_mount_name(mountpoint: str) -> str:
    """The name of ckpt_mount_path, the same in every user's runtime dir (root unmounting
    a user's mount finds it by it). Touches nothing."""
    return f"{_key(mountpoint)}.ckpt"


def default_log_path(mountpoint: str) -> Path:
    return runtime_dir() / f"{_key(mountpoint)}.log"


def control_socket_path(mountpoint: str) -> Path:
    """The daemon's control socket (`dlfs trace`), next to its record; see dlfsd.obs.controlsock."""
    return runtime_dir() / f"{_key(mountpoint)}.sock"


# A root daemon mounting for a user (--uid, the Slurm prolog) keeps its runtime files
# in /run/dlfs, 0700: that user can neither find nor reach its control socket there.
# It binds a second socket for that user in this directory (root's, 0755), owned by
# the user and 0600, so that the user's `dlfs flush` reaches it and nobody else's
# does (the daemon checks SO_PEERCRED on top). Only root can create entries here, so
# a user cannot plant a socket of their own for another user's mount.
USER_SOCKET_DIR = Path("/run/dlfs-user")


def user_socket_path(mountpoint: str) -> Path:
    """The socket a root daemon serves the mount's --uid user on (see USER_SOCKET_DIR).
    Touches nothing."""
    return USER_SOCKET_DIR / f"{_key(mountpoint)}.sock"


def make_user_socket_dir() -> Path:
    """USER_SOCKET_DIR, created 0755 by root; DlfsError if it is not root's alone (a
    directory others may write to could hold anyone's socket under our name)."""
    USER_SOCKET_DIR.mkdir(mode=0o755, exist_ok=True)
    info = USER_SOCKET_DIR.lstat()
    if stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and stat.S_IMODE(info.st_mode) != 0o755:
        os.chmod(USER_SOCKET_DIR, 0o755)  # users must enter it, whatever our umask was
    if not trusted_user_socket_dir():
        raise DlfsError(f"{USER_SOCKET_DIR} is not a directory of root's that only root "
                        "may write to: remove it")
    return USER_SOCKET_DIR


def trusted_user_socket_dir() -> bool:
    """USER_SOCKET_DIR exists, is a real directory, root's, and only root may add to it:
    a socket found there was made by a root daemon, not planted by another user."""
    try:
        info = USER_SOCKET_DIR.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and not info.st_mode & 0o022


#: Daemon logs and summaries: a root daemon's land in /var/log/dlfs for every job, and
#: may name users' paths and files: readable by the admin group, not by every user.
LOG_MODE = 0o640


def open_log_file(path: str, flags: int = os.O_WRONLY | os.O_APPEND | os.O_CREAT) -> int:
    """A descriptor of daemon log (or summary) file `path`, made LOG_MODE whatever the
    umask; a file there already is narrowed to LOG_MODE (never widened), if it is ours.
    A symlink at the name is refused (O_NOFOLLOW): root must not append to, or chmod,
    whatever a link in a log directory points to."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, LOG_MODE)
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and mode & ~LOG_MODE:
            os.fchmod(fd, mode & LOG_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_record(record: DaemonRecord) -> None:
    path = record_path(record.mountpoint)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)


def read_record(mountpoint: str) -> DaemonRecord | None:
    try:
        return DaemonRecord(**json.loads(record_path(mountpoint).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def remove_record(mountpoint: str, pid: int | None = None) -> None:
    """Remove the record (only if it is still ours, when pid is given)."""
    record = read_record(mountpoint)
    if record is None or (pid is not None and record.pid != pid):
        return
    with contextlib.suppress(FileNotFoundError):
        record_path(mountpoint).unlink()


def remove_stale_files(mountpoint: str) -> None:
    """Remove the control socket and status file a daemon killed without its cleanup
    (SIGKILL, the OOM killer) left for `mountpoint`, once no daemon serves it: a lazily
    detached one still answers `dlfs status` and `dlfs trace` through them."""
    record = read_record(mountpoint)
    if serving_daemon(mountpoint) is not None or (record is not None and record.alive()):
        return  # (a foreground daemon has no --config to be found by: its record)
    paths = [control_socket_path(mountpoint), status_path(mountpoint)]
    if os.geteuid() == 0:  # only root's daemons make one, only root may remove it
        paths.append(user_socket_path(mountpoint))
    for path in paths:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            path.unlink()


def daemon_session(mountpoint: str) -> list[int]:
    """Every process of the daemon of canonical `mountpoint` (main, workers, what they
    started), found from its runtime record, never from a command line (any user can
    start a process whose command line reads like a daemon's).

    The record is in our own runtime directory (root's /run/dlfs for the Slurm
    epilog), so its pid is the daemon's as it was written. The daemon runs in a session
    of its own (dlfs.cli.mountctl starts it with start_new_session) whose id is that
    pid, and no process can join a session it did not start. So: if the recorded pid
    still runs as recorded (same start time, our uid in every uid field, its own
    session's leader), its session's processes; if it is gone, the processes left in
    its session that are ours (its orphaned workers: Linux reuses no pid while a
    session still bears it as its id); if the pid now belongs to another process,
    nothing (that session is not the daemon's)."""
    record = read_record(mountpoint)
    if record is None:
        return []
    leader = record.pid
    if pid_alive(leader):
        if record.started and start_time(leader) != record.started:
            return []
        if not all_uids_ours(leader) or session_of(leader) != leader:
            return []
        return [pid for pid in all_pids() if session_of(pid) == leader]
    return [pid for pid in all_pids() if session_of(pid) == leader and all_uids_ours(pid)
            and pid_alive(pid)]



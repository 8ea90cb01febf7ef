"""`dlfs mount` / `dlfs umount`: start and stop the daemon around the kernel mount.

Lives in the core (no pyfuse3 import): it only spawns `python -m dlfsd`,
waits for its readiness line, and talks to fusermount3. A mount left behind
by a dead daemon (ENOTCONN) is cleaned before mounting, and `umount` works
on such a mount too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

from dlfs import __version__
from dlfs.config import MountConfig
from dlfs.errors import DlfsError, NotFoundError, NotMountedError
from dlfs.launch import (
    COMMIT,
    COMMIT_FD_ENV,
    ERROR_PREFIX,
    READY,
    READY_FD_ENV,
    daemon_argv,
    version_refusal,
)
from dlfs.mountinfo import CKPT_DIR, CKPT_FSTYPE, find_mount, mountpoints_of_type
from dlfs.procs import pid_alive, serving_daemon
from dlfs.runtime import (
    ckpt_mount_name,
    daemon_session,
    default_log_path,
    lock_path,
    mountpoint_path,
    open_log_file,
    read_record,
    remove_record,
    remove_stale_files,
)
from dlfs.signals import signals_deferred

log = logging.getLogger(__name__)

FSTYPE = "fuse.dlfs"


def mounted_fstype(mountpoint: str) -> str | None:
    """File-system type mounted at canonical path `mountpoint`, or None."""
    entry = find_mount(mountpoint)
    return entry.fstype if entry else None


def _fusermount(mountpoint: str, lazy: bool) -> subprocess.CompletedProcess:
    """fusermount3 -u; a checkpoint directory mounted on it goes first (a lazy unmount
    detaches both at once; a plain one would find the mount busy). A daemon that is not
    root mounted it outside, MOUNTPOINT/ckpt being a symlink to it
    (dlfs.runtime.ckpt_mount_path): that one goes first, lazily too when asked."""
    # Found by its name, the same in every user's runtime dir: root unmounting a
    # user's mount finds it too.
    name = ckpt_mount_name(mountpoint)
    for outside in mountpoints_of_type(CKPT_FSTYPE):
        if os.path.basename(outside) == name:
            done = _fusermount_one(outside, lazy)
            if done.returncode:
                return done
    ckpt = os.path.join(mountpoint, CKPT_DIR)
    if not lazy and mounted_fstype(ckpt) == CKPT_FSTYPE:
        done = _fusermount_one(ckpt, lazy)
        if done.returncode:
            return done
    return _fusermount_one(mountpoint, lazy)


def _fusermount_one(mountpoint: str, lazy: bool) -> subprocess.CompletedProcess:
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), mountpoint]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise DlfsError("fusermount3 not found: install the fuse3 package") from None


def prepare_mountpoint(mountpoint: str) -> str:
    """Return the canonical path; clean a stale mount; refuse a live or missing one."""
    path = mountpoint_path(mountpoint)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise NotFoundError(f"mountpoint does not exist: {path} (create it: mkdir -p {path})") \
            from None
    except OSError as err:
        if err.errno != errno.ENOTCONN:
            raise DlfsError(f"cannot use mountpoint {path}: {err.strerror}") from None
        _fusermount(path, lazy=True)  # a dead daemon's mount: clean it
        remove_record(path)
    if not os.path.isdir(path):
        raise DlfsError(f"mountpoint is not a directory: {path}")
    if mounted_fstype(path) == FSTYPE:
        record = read_record(path)
        if (record is not None and record.alive()) or serving_daemon(path) is not None:
            raise DlfsError(f"already mounted: {path} (run `dlfs umount {path}` first)")
        # The daemon is gone (the kernel may still answer stat from its cache).
        _fusermount(path, lazy=True)
        remove_record(path)
    _warn_if_not_empty(path)
    return path


def _warn_if_not_empty(path: str) -> None:
    """FUSE mounts over a non-empty directory without a word (fuse3 dropped `nonempty`):
    its files vanish from sight until the unmount, which looks like data loss."""
    try:
        with os.scandir(path) as entries:
            if next(entries, None) is None:
                return
    except OSError:  # a live mount of something else: mounting fails later, in one line
        return
    log.warning("mountpoint %s is not empty: its files are hidden while DLFS is mounted "
                "there", path)


def mount(config: MountConfig, foreground: bool, timeout: float = 120.0,
          commit_fd: int | None = None) -> int:
    """Mount per `config`; in the background, return once the mount answers.

    `commit_fd` (background only): the read end of a pipe the daemon is handed; it
    unmounts itself if the pipe ends before COMMIT is written to it (see
    mount_uncommitted)."""
    with _mount_lock(mountpoint_path(config.mountpoint)):
        config = replace(config, mountpoint=prepare_mountpoint(config.mountpoint))
        if not foreground:
            log_file = daemon_log_path(config)
            return _spawn_and_wait(replace(config, log_file=log_file), timeout, commit_fd)
    import dlfsd.main as daemon  # the daemon's deps load only when we become it

    refusal = version_refusal(getattr(daemon, "__version__", None),
                              os.path.dirname(daemon.__file__ or ""))
    if refusal:
        raise DlfsError(refusal)
    return daemon.run(config)


def daemon_log_path(config: MountConfig) -> str:
    """Where a background daemon of `config` logs (checksum errors, peers, staging)."""
    return config.log_file or str(default_log_path(mountpoint_path(config.mountpoint)))


def mount_uncommitted(config: MountConfig, timeout: float = 120.0) -> int:
    """Mount in the background, for now only: returns a descriptor to pass to
    commit_mount once the mount is to stay. If it is closed first, by this process
    ending in any way (SIGKILL too), the daemon unmounts itself and exits. For
    all-or-nothing launches (`dlfs mount --mpi`), where a launcher that dies between
    mounting and hearing that every other node is up could not clean up itself."""
    read_end, write_end = os.pipe()
    try:
        mount(config, foreground=False, timeout=timeout, commit_fd=read_end)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return write_end


def commit_mount(fd: int, config: MountConfig) -> None:
    """Tell the daemon of a mount_uncommitted(config) to keep its mount (and close
    `fd`)."""
    try:
        os.write(fd, COMMIT)
    except BrokenPipeError:
        log_file = daemon_log_path(config)
        raise DlfsError(f"the daemon of {config.mountpoint} exited before its mount was "
                        f"committed; see {log_file}") from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def _mount_lock(mountpoint: str):
    """One `dlfs mount` of a mountpoint at a time, from the stale-mount check until the
    mount answers: two at once (srun with two tasks per node) would both find the path
    free and mount twice, stacked. A foreground mount holds it only through the
    stale-mount check (it then becomes the daemon)."""
    path = lock_path(mountpoint)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DlfsError(f"another `dlfs mount` of {mountpoint} is under way; wait for "
                            "it, then check with `dlfs status`") from None
        if _still_named(fd, path):
            break
        os.close(fd)  # the holder before us removed it as we opened it: lock the new one
    try:
        yield
    finally:
        # Removed while still held (else one lock file per mountpoint ever mounted
        # piles up: a per-job mountpoint on every node, every job).
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)


def _still_named(fd: int, path: Path) -> bool:
    """`path` still names the file open at `fd`."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _spawn_and_wait(config: MountConfig, timeout: float, commit_fd: int | None = None) -> int:
    read_end, write_end = os.pipe()
    proc = None
    try:
        # A Ctrl-C while Popen runs (the daemon may already be up) must still find
        # `proc` set, or nothing would stop that daemon: hold it until it is.
        # (The log opens first: on a hung file system it may block, and must not
        # block with the signals held.)
        with _open_log(config.log_file) as log, signals_deferred():
            proc = _spawn_daemon(config, log, write_end, commit_fd)
        os.close(write_end)
        write_end = -1
        line = _read_line(read_end, timeout)
        if line == READY:
            _wait_until_answering(config.mountpoint, proc, timeout)
            return 0
        if line.startswith(ERROR_PREFIX):
            proc.wait(timeout=30)
            raise DlfsError(line[len(ERROR_PREFIX) :])
        if line == "":
            code = proc.wait(timeout=30)
            if code == 2:  # argparse: a dlfsd older than VERSION_FLAG refuses its argv
                raise DlfsError(f"the daemon refused the command line of dlfs {__version__} "
                                "(exit code 2): a dlfsd of another release? `dlfs --version` "
                                f"names both; see {config.log_file}")
            raise DlfsError(f"daemon exited with code {code} before mounting; see "
                            f"{config.log_file}")
        raise DlfsError(f"daemon did not come up within {timeout:.0f} s; see {config.log_file}")
    except BaseException:  # failed, timed out, or interrupted (Ctrl-C): leave nothing behind
        if proc is not None:
            _abandon(proc, config.mountpoint)
        raise
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


def _open_log(path: str) -> BinaryIO:
    """The daemon's log file for appending, 0640 (dlfs.runtime.open_log_file); a link
    at its name fails in one line."""
    try:
        return os.fdopen(open_log_file(path), "ab")
    except OSError as err:
        why = "it is a symlink" if err.errno == errno.ELOOP else err.strerror
        raise DlfsError(f"cannot open the log file {path}: {why} (give a plain file path "
                        "with --log-file)") from None


def _spawn_daemon(config: MountConfig, log: BinaryIO, ready_fd: int,
                  commit_fd: int | None = None) -> subprocess.Popen:
    """`python -m dlfsd` in a session of its own, logging to `log`, told to report
    readiness on `ready_fd` (and to wait for COMMIT on `commit_fd`)."""
    env = dict(os.environ)
    env[READY_FD_ENV] = str(ready_fd)
    env.pop(COMMIT_FD_ENV, None)
    pass_fds = [ready_fd]
    if commit_fd is not None:
        env[COMMIT_FD_ENV] = str(commit_fd)
        pass_fds.append(commit_fd)
    return subprocess.Popen(
        daemon_argv(config.to_json()),
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
        pass_fds=pass_fds, start_new_session=True)


def _abandon(proc: subprocess.Popen, mountpoint: str) -> None:
    """Stop a daemon we gave up on, with every process it forked (its own session), and
    take away a mount it may have made meanwhile. A second Ctrl-C (an impatient user)
    waits until that is done: cut short, it would leave a hung daemon or its mount."""
    with signals_deferred():
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
                break
        if mounted_fstype(mountpoint) == FSTYPE:
            _fusermount(mountpoint, lazy=True)
        remove_record(mountpoint)


def _read_line(fd: int, timeout: float) -> str:
    """The daemon's readiness line, '' on EOF, 'TIMEOUT' if it said nothing in time."""
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return "TIMEOUT"
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _wait_until_answering(mountpoint: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DlfsError(f"daemon exited with code {proc.returncode} right after mounting")
        if mounted_fstype(mountpoint) == FSTYPE:
            os.stat(mountpoint)  # blocks until the daemon answered FUSE INIT
            return
        time.sleep(0.01)
    raise DlfsError(f"mount at {mountpoint} did not answer within {timeout:.0f} s")


def umount(mountpoint: str, lazy: bool = False, timeout: float = 30.0) -> int:
    """Unmount and wait for the daemon to exit; also clears a dead daemon's mount.

    A daemon that died without unmounting (its record outlived it) is reported in
    one warning line, with where its log is: the user asked to unmount a live
    mount, and must learn that it had been dead (answering ENOTCONN) instead.
    """
    path = mountpoint_path(mountpoint)
    fstype = mounted_fstype(path)
    record = read_record(path)
    if fstype is None:
        remove_stale_files(path)
        remove_record(path)
        raise NotMountedError(f"not mounted: {path}")
    if fstype != FSTYPE:
        raise DlfsError(f"not a DLFS mount: {path} is {fstype}")
    dead = record is not None and not record.alive()  # not a reused pid of a SIGKILLed one
    result = _fusermount(path, lazy)
    if result.returncode != 0:
        message = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        died = (f"; its daemon (pid {record.pid}) had died: {record.how_it_died()}"
                if dead else "")
        if "busy" in message.lower():
            raise DlfsError(f"mount is busy: {path} (close files and shells using it, "
                            f"or run `dlfs umount --lazy`){died}")
        raise DlfsError(f"cannot unmount {path}: {message}{died}")
    if dead:
        log.warning("the daemon of %s (pid %d) had died: %s; unmounted the dead mount it "
                    "left", path, record.pid, record.how_it_died())
    if lazy and not dead:
        # Detached: the daemon keeps serving files that are still open and
        # exits by itself when the last one is closed.
        return 0
    if not dead and record is not None:
        _wait_for_exit(record.pid, timeout)
    else:  # its main process was killed: its workers die with it (and see the unmount)
        _wait_until_unserved(path, 5.0)
    remove_stale_files(path)  # a killed daemon's (a live one removes its own)
    remove_record(path)
    return 0


def stop_daemon(mountpoint: str, timeout: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL after `timeout`, to every process of the daemon of canonical
    `mountpoint` (dlfs.runtime.daemon_session: by its record, owner and session, never by
    command line). Returns the pids signalled; DlfsError if one survives SIGKILL. Once
    none is left and nothing is mounted there, the record and a dead daemon's files go."""
    found: list[int] = []
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        pids = daemon_session(mountpoint)
        if not pids:
            break
        found.extend(pid for pid in pids if pid not in found)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while daemon_session(mountpoint) and time.monotonic() < deadline:
            time.sleep(0.05)
    left = daemon_session(mountpoint)
    if left:
        raise DlfsError(f"the daemon of {mountpoint} survived SIGKILL: pids "
                        f"{' '.join(map(str, left))} (stuck in the kernel? see "
                        f"`ps -o pid,stat,wchan -p {left[0]}`)")
    if mounted_fstype(mountpoint) is None:
        remove_stale_files(mountpoint)
        remove_record(mountpoint)
    return found


def _wait_until_unserved(mountpoint: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while serving_daemon(mountpoint) is not None and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_for_exit(pid: int, timeout: float) -> None:
    """Give the daemon `timeout` s to finish, then TERM, then KILL."""
    for sig, wait in ((None, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.02)
    raise DlfsError(f"unmounted, but daemon {pid} did not exit even after SIGKILL (stuck "
                    f"in the kernel? see `ps -o pid,stat,wchan -p {pid}`)")

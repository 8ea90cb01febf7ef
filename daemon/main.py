"""The daemon's lifecycle: load datasets, mount, serve until unmounted or signalled.

Started by `dlfs mount` (in-process with --foreground, or as
`python -m dlfsd --config JSON` in its own session). It reports readiness
through the file descriptor in $DLFS_READY_FD: "READY" once the kernel mount
exists, or "ERROR <one line>" if it cannot come up.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

import trio

from dlfs.config import MountConfig
from dlfs.errors import DlfsError
from dlfs.launch import (
    CONFIG_FLAG,
    ERROR_PREFIX,
    READY,
    READY_FD_ENV,
    VERSION_FLAG,
    version_refusal,
)
from dlfs.mountinfo import find_mount
from dlfs.procs import start_time
from dlfs.runtime import DaemonRecord, remove_record, status_path, write_record
from dlfsd import __version__
from dlfsd.assemble import (
    Daemon,
    assemble,
    build_services,
    configure_logging,
    control_server,
    mount_options,
    set_read_ahead,
    start_workers,
)
from dlfsd.base.kernel import INIT_TIMEOUT, kernel_release
from dlfsd.ckptconnect import connect
from dlfsd.commit import LaunchCommit, LauncherPipe, LaunchSecret
from dlfsd.fuse import session
from dlfsd.fuse.wireworker import fuse_fds
from dlfsd.obs.status import write_status
from dlfsd.supervise import (
    HeldStopSignals,
    Teardown,
    still_mounted,
    stop_workers,
    supervise,
    unmount_dead,
)

log = logging.getLogger("dlfsd")


class Readiness(LauncherPipe):
    """Tells the starting `dlfs mount` whether we came up (once), on $DLFS_READY_FD.

    Forked workers and the control process do not hold the pipe (LauncherPipe): if
    this process died before READY, `dlfs mount` would see no end of file and wait
    its whole timeout."""

    def __init__(self) -> None:
        super().__init__(self.fd_from_env(READY_FD_ENV))

    def send(self, message: str) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(self.fd, (message.replace("\n", " ") + "\n").encode(errors="backslashreplace"))
        self.close()


def run(config: MountConfig, readiness: Readiness | None = None) -> int:
    """Mount and serve; returns the process exit code.

    Every resource is released by one ExitStack, in the reverse order it was
    taken, whichever step fails: the order lives where each is acquired.
    """
    readiness = readiness or Readiness()
    commit = LaunchCommit.from_env(LaunchSecret(config.secret_file, config.node,
                                                config.mountpoint))
    configure_logging(config)
    with contextlib.ExitStack() as release:
        try:
            daemon = assemble(config, release)
        except DlfsError as err:
            log.error("%s", err)
            readiness.send(f"{ERROR_PREFIX}{err}")
            return err.exit_code
        except Exception as err:
            return _mount_failed(config, readiness, err)
        # From the mount on, a stop signal must end in the unmount below, never cut in
        # between (a Ctrl-C on `dlfs mount --foreground` right after the mount used to
        # leave a dead mount): it is held, and acted on once supervise listens.
        held = HeldStopSignals()
        held.install()
        release.callback(held.restore)
        try:
            session.mount(config.mountpoint, mount_options(config))
        except Exception as err:  # e.g. RuntimeError from fuse_session_mount
            return _mount_failed(config, readiness, err)
        names = ", ".join(d.name for d in daemon.namespace.datasets)
        log.info("mounted %s at %s (datasets: %s; worker processes: %d)", config.store,
                 config.mountpoint, names, config.workers)
        return _serve(config, daemon, readiness, commit, held, release)


def _serve(config: MountConfig, daemon: Daemon, readiness: Readiness, commit: LaunchCommit,
           held: HeldStopSignals, release: contextlib.ExitStack) -> int:
    """Mounted: start workers and services, say READY, supervise until unmounted."""
    state = Teardown()
    release.callback(log.info, "unmounted %s; daemon exits", config.mountpoint)
    release.callback(remove_record, config.mountpoint, os.getpid())
    release.callback(lambda: state.aborted and unmount_dead(config.mountpoint))
    release.callback(lambda: session.close(unmount=state.unmount))
    release.callback(daemon.namespace.observe.write_summary, config.summary_file)
    control = control_server(config, daemon)
    release.callback(control.stop)
    release.callback(lambda: stop_workers(list(state.workers)))
    if daemon.staging is not None:
        release.callback(daemon.staging.stop_listening)
    ready = False
    try:
        negotiated = session.answer_init(INIT_TIMEOUT, config.request_timeout,
                                         daemon.passthrough.wanted)
        daemon.passthrough.after_init(negotiated.passthrough, kernel_release())
        ours = find_mount(config.mountpoint)  # this connection's device, to know it later
        set_read_ahead(config.mountpoint, config.read_ahead_kb)  # INIT would reset it
        state.workers = start_workers(config, daemon)
        ckpt = None
        if daemon.ckpt is not None:  # after the datasets' workers: they answer its LOOKUP
            ckpt_workers, ckpt = connect(daemon.ckpt, daemon.namespace, release)
            state.workers.update(ckpt_workers)
        services = build_services(config, daemon, ckpt, session.report(negotiated))
        if daemon.order is not None and daemon.order.listen():  # after the workers fork
            release.callback(daemon.order.close)
        # `dlfs trace` (after the workers: it must not serve FUSE, nor hold /dev/fuse)
        control.start(close_in_child=fuse_fds())
        services.listen(fuse_fds())  # after the workers: they must not inherit the listener
        write_record(DaemonRecord(os.getpid(), config.mountpoint, config.store, config.log_file,
                                  start_time(os.getpid())))
        write_status(status_path(config.mountpoint), services.status())  # before READY
        readiness.send(READY)
        ready = True
        state.unmount = trio.run(supervise, config.mountpoint, state.workers, services, held,
                                 commit)
        state.aborted = still_mounted(config.mountpoint, ours) if not state.unmount else False
    except DlfsError as err:
        if ready:
            raise
        log.error("%s", err)
        readiness.send(f"{ERROR_PREFIX}{err}")
        return err.exit_code
    return 0


def _mount_failed(config: MountConfig, readiness: Readiness, err: Exception) -> int:
    """An unexpected error before serving: logged with its traceback, one line to
    `dlfs mount`."""
    log.exception("mount failed")
    readiness.send(f"{ERROR_PREFIX}cannot mount {config.mountpoint}: {err}")
    return 1


class _PrintVersion(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(self.const)
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    """`python -m dlfsd --config JSON [--launcher-version V]`: refuse a launcher of
    another release before anything else (one ERROR line through the readiness pipe),
    else mount and serve."""
    here = str(Path(__file__).resolve().parent)
    parser = argparse.ArgumentParser(
        prog="dlfsd",
        description="DLFS per-node daemon. Normally started by `dlfs mount`; see `dlfs mount -h`.")
    # One line however long the path (argparse's "version" action wraps it): `dlfs
    # --version` reads it.
    parser.add_argument("--version", nargs=0, action=_PrintVersion, default=argparse.SUPPRESS,
                        const=f"dlfsd {__version__} ({here})",
                        help="show the version and where the daemon's code is, and exit")
    parser.add_argument(CONFIG_FLAG, required=True, help="MountConfig as JSON")
    parser.add_argument(VERSION_FLAG, metavar="VERSION",
                        help="the release of the `dlfs` starting us; another one is refused")
    args = parser.parse_args(argv)
    if args.launcher_version is not None:
        refusal = version_refusal(__version__, here, args.launcher_version)
        if refusal:
            print(f"dlfsd: error: {refusal}", file=sys.stderr)
            Readiness().send(f"{ERROR_PREFIX}{refusal}")
            return 1
    return run(MountConfig.from_json(args.config))

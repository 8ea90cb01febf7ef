"""The main process's watch: its forked workers, the stop signals, the end of a mount.

The workers serve FUSE, one request at a time each (dlfsd.assemble starts them);
the main process only runs the services (dlfsd.services) and watches: it reaps
workers as they exit and hands a dead one's requests to the others, holds stop
signals until it can act on them (a signal must end in an unmount, never cut
one in two), and waits for the launcher's commit of an all-or-nothing launch.
What the unmount must know when the daemon's ExitStack unwinds (Teardown)
lives here too, with the lazy unmount of a connection that was aborted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from dlfs.mountinfo import find_mount
from dlfs.signals import STOP_SIGNALS, stop_signals_blocked
from dlfsd.base.lineage import die_with_parent, parent_alive
from dlfsd.commit import LaunchCommit
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse.wireworker import WORKER_ABORTED

log = logging.getLogger("dlfsd")


class Running(Protocol):
    """What supervise runs beside watching the workers: dlfsd.services.Services (a
    protocol, not an import: the services' checkpoint part starts from dlfsd.ckptconnect,
    which forks its workers through this module)."""

    connection_lost: bool  # set when a connection aborted or its workers died

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None: ...


async def watch_workers(served: dict[int, int]) -> bool:
    """Reap worker processes as they exit (`served`: pid -> the /dev/fuse descriptor of
    the connection it serves, the datasets' or the checkpoint directory's). Exit code 0
    is a normal end (unmounted).

    A worker that dies while mounted (OOM killer, a bug) held the request it was
    serving: the kernel would wait for that answer forever, and the process that
    asked would hang unkillably. So its requests are handed back to the kernel's
    queue (NOTIFY_RESEND) and the others serve them: dataset requests are idempotent
    (the data never changes); a checkpoint create or rename that the dead worker had
    done but not answered fails when it comes again (EEXIST, ENOENT), which beats a
    hang. Where the kernel
    cannot (< 6.9), or none is left on that connection, we stop the mount instead:
    readers then get ENOTCONN, not a hang. Returns once all are gone, or False as
    soon as the mount must stop.
    """
    with trio.open_signal_receiver(signal.SIGCHLD) as sigs:
        while served:
            for pid in list(served):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done:
                    continue
                fuse_fd = served.pop(pid)
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                    continue
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == WORKER_ABORTED:
                    log.error("the FUSE connection was aborted (umount -f or fusectl)")
                    return False
                how = (f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
                       if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}")
                left = sum(1 for fd in served.values() if fd == fuse_fd)
                if not left:
                    log.error("worker process %d died (%s), the last one of its connection; "
                              "unmounting", pid, how)
                    return False
                try:
                    os.write(fuse_fd, fw.resend_notification())
                except OSError as err:
                    log.error("worker process %d died (%s) and the kernel cannot hand its "
                              "request to the others (%s; Linux >= 6.9 can); unmounting so "
                              "that no reader hangs", pid, how, err.strerror)
                    return False
                log.error("worker process %d died (%s); its unanswered requests went back "
                          "to the queue, %d worker processes serve on", pid, how, left)
            if served:
                await sigs.__anext__()
    return True


class HeldStopSignals:
    """From the mount on, a stop signal outside supervise's own receiver is recorded,
    not acted on: one that comes before the receiver is up stops the daemon as soon as
    it is (a Ctrl-C right after mounting must not leave a dead mount); those that come
    during the unmount (an impatient user, a scheduler repeating TERM) must not kill
    the daemon before it stopped its workers and unmounted, or the workers would go on
    serving a mount nobody takes down. `dlfs umount` ends with SIGKILL if a daemon ever
    hangs."""

    def __init__(self) -> None:
        self.caught: list[int] = []
        self._before: dict[int, object] = {}

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            self._before[signum] = signal.signal(signum, self._record)

    def restore(self) -> None:
        """The handlers from before install (run() may be called in a longer-lived
        process: the foreground CLI, tests)."""
        for signum, handler in self._before.items():
            signal.signal(signum, handler)
        self._before = {}

    def _record(self, signum: int, frame) -> None:
        self.caught.append(signum)


async def supervise(mountpoint: str, workers: dict[int, int], services: Running,
                    held: HeldStopSignals | None = None,
                    commit: LaunchCommit | None = None) -> bool:
    """The main process: run the background services (stager, peer server, status) and
    watch the workers that serve FUSE.

    Returns True if the mount must be unmounted by us (signal, workers died, or the
    launcher went away without committing the mount).
    """
    must_unmount = False
    async with trio.open_nursery() as nursery:
        await nursery.start(services.run)

        def stop() -> None:
            nonlocal must_unmount
            must_unmount = True
            nursery.cancel_scope.cancel()

        async def watch_signals() -> None:
            with trio.open_signal_receiver(*STOP_SIGNALS) as sigs:
                if held is not None and held.caught:  # came before the receiver was up
                    await _send_self(held.caught[0])
                async for signum in sigs:
                    log.info("got %s; unmounting %s", signal.Signals(signum).name,
                             mountpoint)
                    stop()
                    return

        async def watch_commit() -> None:
            if not await commit.wait():
                log.error("the `dlfs mount --mpi` rank that started this daemon exited or "
                          "gave up before committing this mount; unmounting %s",
                          mountpoint)
                commit.give_up()
                stop()

        nursery.start_soon(watch_signals)
        if commit is not None and commit.pending:
            nursery.start_soon(watch_commit)
        if not await watch_workers(workers):
            must_unmount = True
            services.connection_lost = True
        nursery.cancel_scope.cancel()
    return must_unmount


@dataclass
class Teardown:
    """What the release callbacks of a mounted daemon must know when they run."""

    workers: dict[int, int] = field(default_factory=dict)  # pid -> its /dev/fuse descriptor
    unmount: bool = True  # unless the kernel already unmounted us (fusermount3 -u)
    aborted: bool = False  # the connection was aborted and the dead mount is still there


def still_mounted(mountpoint: str, ours) -> bool:
    """Our mount (same device: not one mounted there since by another daemon) is still
    at `mountpoint`."""
    now = find_mount(mountpoint)
    return ours is not None and now is not None and now.device == ours.device


def unmount_dead(mountpoint: str) -> None:
    """The workers saw the connection end, yet our mount is still there: it was
    aborted (fusectl, umount -f, an expired request timeout) and answers ENOTCONN for
    good. Closing the session leaves an aborted connection's mount alone, so take it
    down here, lazily (a process may
    still have it as its cwd)."""
    log.error("the FUSE connection was aborted (fusectl, umount -f, or a request left "
              "unanswered past the request timeout) with %s still mounted; unmounting it",
              mountpoint)
    try:
        done = subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.error("cannot unmount %s: %s; run `dlfs umount %s`", mountpoint, err, mountpoint)
        return
    if done.returncode:
        log.error("cannot unmount %s: %s; run `dlfs umount %s`", mountpoint,
                  done.stderr.strip(), mountpoint)


async def _send_self(signum: int) -> None:
    """Deliver a held signal again, now to the receiver that is listening."""
    signal.raise_signal(signum)
    await trio.lowlevel.checkpoint()


def fork_workers(count: int, serve: Callable[[], int], mountpoint: str) -> list[int]:
    """Fork `count` processes, each running `serve` until it returns its exit code."""
    pids = []
    parent = os.getpid()
    for _ in range(count):
        with stop_signals_blocked():  # until the worker's own handlers are in (serve)
            pid = os.fork()
            if pid == 0:  # worker: serve until unmount or SIGTERM, then leave, no cleanup
                code = 0
                try:
                    # SIGTERM when the main process dies (SIGKILL, OOM): a worker must not
                    # serve on unsupervised, holding the mount up (dlfsd.base.lineage).
                    if die_with_parent(parent):
                        code = serve()
                    if not parent_alive(parent):
                        log.error("worker %d stops: the main daemon process %d died (killed?); "
                                  "the mount ends with its last worker (readers get "
                                  "ENOTCONN until `dlfs umount %s`)", os.getpid(), parent,
                                  mountpoint)
                except BaseException:
                    log.exception("worker %d failed", os.getpid())
                    code = 1
                finally:
                    logging.shutdown()
                    os._exit(code)
        pids.append(pid)
    return pids


def stop_workers(pids, timeout: float = 10.0) -> None:
    """Ask the workers not reaped yet to stop, and reap them (SIGKILL after `timeout`)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)

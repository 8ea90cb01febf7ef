"""PeerServers: the daemon's peer server, run by forked processes that share one port.

Why processes: the server's loops used to be threads of the daemon's main process,
and threads share one GIL. On a 16-core machine (bench/peer_serve.py, 8 client
processes, 110 KiB READs from the page cache) 1 loop served 21,158 READs/s at
47 us of server CPU each, 2 loops 21,062, 4 loops 17,300, 8 loops 16,089 (103 us
each): more loops served less. Processes each have their own interpreter, as the
FUSE side's forked workers do, so a holder serves with as many cores as it has
server processes (`dlfs mount --peer-procs N|auto`; 0 keeps the loops in the main
process, the old way, for comparison).

How they share the port: the main process binds and listens (a port taken since
the mount looked fails the mount in one line, as before), then forks one
supervisor process, which forks the servers; each runs a PeerLoopServer on the
inherited listening socket. The kernel wakes every server for a new connection
and one of them accepts it; each takes one connection per wake-up, so a burst of
connections (a reading node's workers all connect at once) spreads over the
servers that are free. Not SO_REUSEPORT: any process of the same user could then
bind the port as well, and a second job's daemon on the node would share the
first one's port silently instead of moving on to the job's next port.

Why a supervisor process and not the main process: once the mount serves, the
main process runs threads (the stager's copies, the drain, the scrub), and a
child forked from a threaded process inherits every lock those threads held at
that moment (a log file's buffer, a cache's open lock) with nobody left to
release it. The supervisor never runs a thread, so it can restart a server at any
time: a server that dies (a bug, the OOM killer, kill -9) is logged once and
started again, at once the first time and after a back-off (1 s doubling to
60 s) while it keeps dying young; the others serve on meanwhile. Should the
supervisor itself die, the main process logs it and starts another (the servers
end with it: their parent-death signal), resetting the log file's stream there;
a lock of another kind held at that instant is the one risk left, in a doubly
rare event.

What a server asks of the chunk pool works from any process: staged copies are
shared state (ChunkCache), demands go down the stager's pipe, whether the stager
will stage a chunk is in the stager's shared memory, --verify-served's "checked
in this copy" bytes are shared, an eviction is a file operation. Counters: each
loop of each server writes its own row of an anonymous shared mapping made before
the fork, which the main process sums for `dlfs status`; the node's open
connections are summed from those rows for its connection slots, and the per-node
limits on unauthenticated connections and report checks are split between the
servers (dlfsd.pool.admission).

Teardown: the main process stops the supervisor (SIGTERM), which stops its
servers (SIGTERM: each closes its connections) and reaps them, SIGKILL past a
timeout. Killed without cleanup, the main process takes the supervisor with it
and the supervisor its servers (PR_SET_PDEATHSIG, dlfsd.lineage), and each also
looks every second whether its parent is still there.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import signal
import socket
import time
from collections.abc import Callable, Collection

import trio

from dlfs.signals import stop_signals_blocked
from dlfsd.base.lineage import die_with_parent, name_process, parent_alive
from dlfsd.pool.peerserver import (
    COUNTERS,
    OPEN,
    BlockingChunkProvider,
    PeerLoopServer,
    listen,
    sum_rows,
)

log = logging.getLogger("dlfsd.pool.peer")

MAX_PROCESSES = 8
YOUNG = 10.0  # seconds: a server that dies younger is restarted after a back-off
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 60.0
STOP_TIMEOUT = 5.0  # seconds a server (or the supervisor) may take to stop before SIGKILL
_WAKE = 1.0  # seconds between a supervisor's or a server's looks at its parent


def peer_processes(wanted: int | None) -> int:
    """Server processes for `--peer-procs`: `wanted`, or (None: auto) half the cores
    this daemon may run on (its CPU affinity, as a job step's binding sets it; the
    other half is the FUSE workers'), 1 to MAX_PROCESSES. 0: the loops run in the main
    process. Not more than the cores: each request wakes the process that takes it,
    so processes sharing a core split the requests and each pays its wake-ups (on one
    CPU, bench/pool_read.py --pin: 2 processes 220 us of holder CPU per sample cold,
    140 hot; 1 process or the main process's loop 187-197 and 120-137). One is
    enough to survive its own death: the port stays open in its supervisor, which
    starts another at once, and peers reconnect within their read."""
    if wanted is not None:
        return max(0, wanted)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_PROCESSES, cores // 2))


class _Board:
    """What the servers and their supervisor publish for the main process, in shared
    memory made before the fork: each loop's counter row, each server's pid (0 while
    none runs in its place) and the restarts."""

    def __init__(self, processes: int, loops: int) -> None:
        n = len(COUNTERS)
        rows = processes * loops
        self.loops = loops
        self._map = mmap.mmap(-1, 8 * (rows * n + processes + 1))
        words = memoryview(self._map).cast("q")
        self.rows = [words[i * n:(i + 1) * n] for i in range(rows)]
        self.pids = words[rows * n:rows * n + processes]
        self.restarts = words[rows * n + processes:]
        self._views = [words, *self.rows, self.pids, self.restarts]

    def rows_of(self, slot: int) -> list[memoryview]:
        return self.rows[slot * self.loops:(slot + 1) * self.loops]

    def open_connections(self) -> int:
        """The node's open peer connections, every server's."""
        return sum(row[OPEN] for row in self.rows)

    def forget_open(self, slot: int) -> None:
        """A server is gone, and its connections with it."""
        for row in self.rows_of(slot):
            row[OPEN] = 0

    def close(self) -> None:
        for view in reversed(self._views):
            view.release()
        self._map.close()


class PeerServers:
    """The peer server of a daemon: `processes` forked servers (0: loops in this
    process), each a PeerLoopServer made with `server`'s arguments."""

    def __init__(self, secret: bytes, provider: BlockingChunkProvider, node_name: str, *,
                 processes: int, threads: int = 1, **server) -> None:
        """Made before the fork (the shared counters); nothing runs until start()."""
        self.processes = processes
        self.node_name = node_name
        self._make: Callable[..., PeerLoopServer] = lambda **more: PeerLoopServer(
            secret, provider, node_name, threads=threads, **server, **more)
        self._board = _Board(processes, max(1, threads)) if processes else None
        self._inproc: PeerLoopServer | None = None
        self._listener: socket.socket | None = None
        self._close_in_child: Collection[int] = ()
        self._supervisor = 0
        self._stopping = False

    # -- the main process --------------------------------------------------------------
    def start(self, host: str, port: int, close_in_child: Collection[int] = ()) -> int:
        """Listen now (OSError if the port is taken) and serve; returns the port.
        `close_in_child`: descriptors the forked processes must not hold (the mount's
        /dev/fuse: while any process holds it the kernel keeps the connection up)."""
        if not self.processes:
            self._inproc = self._make()
            bound = self._inproc.start(host, port)
            return bound
        self._listener = listen(host, port)
        self._close_in_child = tuple(close_in_child)
        bound = self._listener.getsockname()[1]
        self._supervisor = self._fork_supervisor()
        log.info("peer server of %s listening on %s:%d (%d processes, %d loop threads "
                 "each)", self.node_name, host, bound, self.processes, self._board.loops)
        return bound

    def counters(self) -> dict[str, int]:
        """Every server's counters summed, with the servers running (`processes`) out of
        `configured` (fewer while a slot waits out a crash loop's back-off), and started
        again after one died (`restarts`)."""
        if self._inproc is not None:
            return self._inproc.counters()
        if self._board is None:
            return {}
        total = sum_rows(self._board.rows)
        total["processes"] = sum(1 for pid in self._board.pids if pid)
        total["configured"] = self.processes
        total["restarts"] = self._board.restarts[0]
        return total

    def counters_by_process(self) -> list[dict[str, int]]:
        """Each server's counters (its loops' summed), by slot: how the connections and
        reads spread over the processes (benchmarks, tests)."""
        if self._board is None:
            return [self.counters()] if self._inproc is not None else []
        return [sum_rows(self._board.rows_of(slot)) for slot in range(self.processes)]

    async def watch(self) -> None:
        """In the main process's trio loop: start another supervisor if this one dies
        (logged once each time), until stop()."""
        if not self._supervisor:
            return
        backoff = 0.0
        while True:
            pid, started = self._supervisor, time.monotonic()
            status = await _exited(pid)
            if self._stopping or pid != self._supervisor:
                return
            self._supervisor = 0
            due, backoff = _restart_at(started, backoff)
            log.error("the peer server's supervisor process %d died (%s); its %d servers "
                      "end with it; starting them again %s", pid, _how(status),
                      self.processes, _when(due))
            await _servers_gone(self._board, STOP_TIMEOUT + _WAKE)
            while not self._supervisor:
                await trio.sleep_until(trio.current_time() + max(0.0, due - time.monotonic()))
                if self._stopping:
                    return
                try:
                    self._supervisor = self._fork_supervisor()
                except OSError as err:  # out of processes for a moment
                    log.error("cannot start the peer server's supervisor again: %s", err)
                    backoff = _longer(backoff)
                    due = time.monotonic() + backoff
            self._board.restarts[0] += self.processes

    def stop(self) -> None:
        """Stop serving and leave no process behind (idempotent)."""
        self._stopping = True
        if self._inproc is not None:
            self._inproc.stop()
            self._inproc = None
        if self._supervisor:
            _terminate([self._supervisor], 2 * STOP_TIMEOUT)
            self._supervisor = 0
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._board is not None:
            self._board.close()
            self._board = None

    def _fork_supervisor(self) -> int:
        parent = os.getpid()
        with stop_signals_blocked():  # a SIGTERM before its mask is set must wait for it
            pid = os.fork()
            if pid == 0:
                _run_child(lambda: self._supervise(parent))
        return pid

    # -- the supervisor process ------------------------------------------------------------
    def _supervise(self, parent: int) -> int:
        """Start the servers, restart those that die, stop them all on SIGTERM or when
        the main process is gone."""
        for fd in self._close_in_child:
            with contextlib.suppress(OSError):
                os.close(fd)
        _fresh_log_streams()
        name_process("dlfsd-peers")
        if not die_with_parent(parent):
            return 0
        board = self._board
        children: dict[int, tuple[int, float]] = {}  # pid -> (slot, started)
        due = [0.0] * self.processes  # when an empty slot may start a server again
        backoff = [0.0] * self.processes
        ever = [False] * self.processes  # a server has run in that slot
        try:
            while parent_alive(parent):
                self._fill(children, due, ever)
                got = signal.sigtimedwait((signal.SIGTERM, signal.SIGCHLD), _WAKE)
                if got is not None and got.si_signo == signal.SIGTERM:
                    break
                for pid, status in _reaped():
                    slot, started = children.pop(pid, (-1, 0.0))
                    if slot >= 0:
                        board.pids[slot] = 0
                        board.forget_open(slot)
                        due[slot], backoff[slot] = _restart_at(started, backoff[slot])
                        log.error("peer server process %d died (%s); %d of %d serve on, "
                                  "another starts %s", pid, _how(status), len(children),
                                  self.processes, _when(due[slot]))
        finally:
            _terminate(list(children), STOP_TIMEOUT)
        if not parent_alive(parent):
            log.error("peer server processes stop: the main daemon process %d died "
                      "(killed?)", parent)
        return 0

    def _fill(self, children: dict[int, tuple[int, float]], due: list[float],
              ever: list[bool]) -> None:
        """Start a server in every empty slot whose back-off is over."""
        running = {slot for slot, _ in children.values()}
        now = time.monotonic()
        me = os.getpid()
        for slot in range(self.processes):
            if slot in running or now < due[slot]:
                continue
            try:
                pid = os.fork()
            except OSError as err:  # out of processes for a moment: the next look
                log.error("cannot start a peer server process: %s", err)
                due[slot] = now + BACKOFF_FIRST
                continue
            if pid == 0:
                _run_child(lambda slot=slot: self._serve(slot, me))
            children[pid] = (slot, now)
            self._board.pids[slot] = pid
            self._board.restarts[0] += ever[slot]
            ever[slot] = True

    # -- a server process -------------------------------------------------------------------
    def _serve(self, slot: int, supervisor: int) -> int:
        """Serve on the inherited socket until SIGTERM or the supervisor is gone."""
        name_process(f"dlfsd-peer {slot}")
        if not die_with_parent(supervisor):
            return 0
        board = self._board
        server = self._make(counts=board.rows_of(slot), open_connections=board.open_connections,
                            processes=self.processes)
        server.serve_on(self._listener)
        try:
            while parent_alive(supervisor):
                if signal.sigtimedwait((signal.SIGTERM,), _WAKE) is not None:
                    return 0
                if not server.serving():  # a loop ended on an error (logged): another
                    return 1  # process serves better than one that no longer accepts
        finally:
            server.stop()
        return 0


def _run_child(body: Callable[[], int]) -> None:
    """In a forked child: SIGTERM and SIGCHLD are waited for, never handled (a server
    is stopped by its supervisor; Ctrl-C and a terminal's hangup reach the whole
    process group, and the main process acts on them); run `body`, then leave
    without any of the parent's cleanup."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)  # the parent's trio loop's, if it ran one
        signal.pthread_sigmask(signal.SIG_SETMASK, {signal.SIGTERM, signal.SIGCHLD})
        code = body()
    except BaseException:
        log.exception("peer server process %d failed", os.getpid())
    finally:
        logging.shutdown()
        os._exit(code)


_ABANDONED: list = []  # the parent's log streams, never closed here (see below)


def _fresh_log_streams() -> None:
    """Log files get a stream of their own in this process: the parent's may have been
    in the middle of a write by another thread at the fork, its lock held for good
    (kept referenced: closing it would wait for that lock)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            _ABANDONED.append(handler.stream)
            handler.stream = None  # reopened (appending) by the next line logged


def _reaped() -> list[tuple[int, int]]:
    """(pid, wait status) of every child that has ended, reaped."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if not pid:
            return done
        done.append((pid, status))


def _restart_at(started: float, backoff: float) -> tuple[float, float]:
    """(when a dead server's slot starts another, the back-off after that): at once
    after a long life and the first time it dies young, then later and later (1 s
    doubling to 60 s) while it keeps dying young: a crash loop must not spin."""
    now = time.monotonic()
    if now - started > YOUNG:
        return 0.0, 0.0
    return now + backoff, _longer(backoff)


def _longer(backoff: float) -> float:
    return min(BACKOFF_MAX, max(BACKOFF_FIRST, backoff * 2))


def _when(due: float) -> str:
    wait = due - time.monotonic()
    return "now" if wait <= 0 else f"in {wait:.0f} s (it died young again)"


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def _terminate(pids: list[int], timeout: float) -> None:
    """SIGTERM children, reap them, SIGKILL those still there after `timeout`."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            while not os.waitpid(pid, os.WNOHANG)[0]:
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)


async def _exited(pid: int) -> int:
    """Wait for a child to end (a pidfd where the kernel has them, else a look every
    second) and reap it; its wait status."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    try:
        while True:
            if fd >= 0:
                await trio.lowlevel.wait_readable(fd)
            else:
                await trio.sleep(_WAKE)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
    finally:
        if fd >= 0:
            os.close(fd)


async def _servers_gone(board: _Board, timeout: float) -> None:
    """Wait (at most `timeout`) for the servers of a dead supervisor to end (their
    parent-death signal stops them at once), then clear their places: their
    connections are gone, and their counter rows are the next servers' (two
    processes adding to one word would lose counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid and _running(pid) for pid in board.pids):
        await trio.sleep(0.02)
    for slot in range(len(board.pids)):
        board.pids[slot] = 0
        board.forget_open(slot)


def _running(pid: int) -> bool:
    """Not ended: a zombie (not reaped yet by whoever adopted it) has."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False

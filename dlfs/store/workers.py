"""Forked worker processes for populate: the scan's directory listings and the copy's tasks.

Why processes: the per-entry work of both (an lstat and a few appends; an open,
read, fstat, close and checksum) is Python calls that hold the GIL, so threads
would run it one at a time. Workers are forked (no interpreter start, no
import) once per phase and get requests over a pipe each; replies come back the
same way. A request's exception travels back pickled and is raised in the
parent: DlfsError (the source) and OSError (the store) as themselves, anything
else as a RuntimeError carrying the worker's traceback.

Lifecycle: a worker exits at the end of its request pipe, so it also stops by
itself once its parent is gone (SIGKILL included), after the request under way.
It ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the
parent decides), dies of SIGTERM, and never returns into the caller's stack
(os._exit). Leaving the pool after a failure or an interrupt sends SIGTERM;
either way every worker is reaped before the pool is left, so none writes into a
temporary directory the caller is about to remove.

A pool of one does its requests inline, in the calling process: no fork.

Why not concurrent.futures.ProcessPoolExecutor: on Python 3.11 it has no public way
to stop a worker in the middle of a request (shutdown waits for the requests under
way, or leaves them running with wait=False), yet an interrupted populate must stop
its workers before it removes the temporary directory they write into; and its
feeder and management threads would be running when the copy forks its workers.
"""

from __future__ import annotations

import os
import pickle
import selectors
import signal
import struct
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

from dlfs.errors import DlfsError
from dlfs.signals import stop_signals_blocked, unblock_stop_signals

# Requests a worker holds at once: the next one is there when it finishes one.
REQUESTS_PER_WORKER = 2
_HEADER = struct.Struct("<qQ")  # tag, length of the pickle that follows
_REPLY = struct.Struct("<qBQ")  # tag, 1 if the pickle is an exception, its length
_READ_SIZE = 1 << 20


class Job(Protocol):
    """What the workers run: `start` once in each process that does requests, `run` per
    request (its return value is the reply), `stop` at the end."""

    def start(self) -> None: ...

    def run(self, request: Any) -> Any: ...

    def stop(self) -> None: ...


def worker_pool(job: Job, count: int) -> InlinePool | ForkedPool:
    """`count` forked workers for `job`, or the calling process when count <= 1. Use as a
    context manager; make it before starting any thread (fork copies only the caller)."""
    return ForkedPool(job, count) if count > 1 else InlinePool(job)


class InlinePool:
    """Requests done in this process, one at a time, when their replies are collected."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._next: tuple[int, Any] | None = None

    def __enter__(self) -> InlinePool:
        self.job.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.job.stop()

    def has_room(self) -> bool:
        return self._next is None

    def submit(self, tag: int, request: Any) -> None:
        self._next = (tag, request)

    def finished(self) -> list[tuple[int, Any]]:
        assert self._next is not None, "nothing submitted"
        (tag, request), self._next = self._next, None
        return [(tag, self.job.run(request))]


@dataclass
class _Worker:
    pid: int
    requests_w: int
    replies_r: int
    pending: int = 0
    received: bytearray = field(default_factory=bytearray)


class ForkedPool:
    """`count` forked worker processes; see the module docstring."""

    def __init__(self, job: Job, count: int) -> None:
        self.job = job
        self.count = count
        self.workers: list[_Worker] = []
        self._selector = selectors.DefaultSelector()

    def __enter__(self) -> ForkedPool:
        try:
            for _ in range(self.count):
                self._fork()
        except BaseException:
            self._stop(kill=True)
            raise
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop(kill=exc_type is not None)

    def _fork(self) -> None:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        # Signals wait until the child is on the books, so an interrupt right after the
        # fork still stops and reaps it.
        with stop_signals_blocked():
            try:
                pid = os.fork()
            except BaseException:
                for fd in (requests_r, requests_w, replies_r, replies_w):
                    os.close(fd)
                raise
            if pid == 0:  # never returns
                _worker_main(self.job, requests_r, replies_w,
                             [fd for w in self.workers for fd in (w.requests_w, w.replies_r)]
                             + [requests_w, replies_r])
            os.close(requests_r)
            os.close(replies_w)
            worker = _Worker(pid, requests_w, replies_r)
            self.workers.append(worker)
            self._selector.register(replies_r, selectors.EVENT_READ, worker)

    def has_room(self) -> bool:
        return any(w.pending < REQUESTS_PER_WORKER for w in self.workers)

    def submit(self, tag: int, request: Any) -> None:
        """Hand a request to the least busy worker (never blocks: requests are small)."""
        worker = min(self.workers, key=lambda w: w.pending)
        payload = pickle.dumps(request, pickle.HIGHEST_PROTOCOL)
        try:
            _write_all(worker.requests_w, _HEADER.pack(tag, len(payload)) + payload)
        except BrokenPipeError:  # it died since its last reply
            raise self._died(worker) from None
        worker.pending += 1

    def finished(self) -> list[tuple[int, Any]]:
        """(tag, reply) of the requests done since the last call (waits for one at least);
        a failed request raises its exception here."""
        done: list[tuple[int, Any]] = []
        while not done:
            for key, _ in self._selector.select():
                worker: _Worker = key.data
                data = os.read(worker.replies_r, _READ_SIZE)
                if not data:
                    raise self._died(worker)
                worker.received += data
                done += self._replies(worker)
        return done

    def _replies(self, worker: _Worker) -> list[tuple[int, Any]]:
        done = []
        buf = worker.received
        at = 0
        while len(buf) - at >= _REPLY.size:
            tag, failed, size = _REPLY.unpack_from(buf, at)
            end = at + _REPLY.size + size
            if len(buf) < end:
                break
            reply = pickle.loads(buf[at + _REPLY.size:end])  # our own child, a private pipe
            at = end
            worker.pending -= 1
            if failed:
                del buf[:at]
                raise reply
            done.append((tag, reply))
        del buf[:at]
        return done

    def _died(self, worker: _Worker) -> DlfsError:
        """The error for a worker gone without a word (killed, out of memory): reaped."""
        pid = worker.pid
        _, status = os.waitpid(pid, 0)
        worker.pid = 0
        how = (f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
               if os.WIFSIGNALED(status) else f"exit status {os.waitstatus_to_exitcode(status)}")
        return DlfsError(f"populate worker process {pid} died ({how}); nothing was published")

    def _stop(self, kill: bool) -> None:
        """No more requests (a worker exits at the end of its pipe); after a failure or
        an interrupt, SIGTERM too, not waiting for requests under way. Then reap them
        all."""
        for worker in self.workers:
            os.close(worker.requests_w)
            if kill and worker.pid:
                os.kill(worker.pid, signal.SIGTERM)
        for worker in self.workers:
            if worker.pid:
                os.waitpid(worker.pid, 0)
                worker.pid = 0
            self._selector.unregister(worker.replies_r)
            os.close(worker.replies_r)
        self.workers = []
        self._selector.close()


def _worker_main(job: Job, requests_r: int, replies_w: int, not_ours: list[int]) -> None:
    """A forked worker: do the requests that come down the pipe until it ends. Never
    returns into the caller's stack (os._exit), whatever happens."""
    code = 1
    try:
        for fd in not_ours:  # the parent's ends: their pipes must end when the parent goes
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        unblock_stop_signals()
        job.start()
        while True:
            header = _read_exactly(requests_r, _HEADER.size)
            if not header:
                break
            tag, size = _HEADER.unpack(header)
            request = pickle.loads(_read_exactly(requests_r, size))
            try:
                reply, failed = pickle.dumps(job.run(request), pickle.HIGHEST_PROTOCOL), 0
            except BaseException as err:  # reported to the parent, which raises it
                reply, failed = _pickle_error(err), 1
            _write_all(replies_w, _REPLY.pack(tag, failed, len(reply)) + reply)
        job.stop()
        code = 0
    except BaseException:  # the parent sees the pipe end and says so
        pass
    finally:
        os._exit(code)


def _pickle_error(err: BaseException) -> bytes:
    if isinstance(err, DlfsError | OSError):
        try:
            return pickle.dumps(err)
        except Exception:  # an unpicklable one goes as its traceback
            pass
    return pickle.dumps(RuntimeError("populate worker failed: "
                                     + "".join(traceback.format_exception(err))))


def _read_exactly(fd: int, size: int) -> bytes:
    """`size` bytes, or b"" at the end of the pipe."""
    parts = []
    got = 0
    while got < size:
        more = os.read(fd, min(size - got, _READ_SIZE))
        if not more:
            return b""
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

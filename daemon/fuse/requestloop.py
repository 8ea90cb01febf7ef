"""RequestLoop: what every worker process serving a FUSE connection does, whatever it
serves: read one request from /dev/fuse, call its handler, write the answer.

Two connections are served this way: the datasets (dlfsd.fuse.wireworker) and the
checkpoint directory (dlfsd.fuse.ckptworker). One request at a time per process,
its blocking I/O inline (the libfuse multi-thread model): a blocked read() of
/dev/fuse wakes exactly one waiting process per request, and a process never holds
a request it is not working on.
"""

from __future__ import annotations

import errno
import logging
import os
import signal

from dlfs.signals import STOP_SIGNALS, unblock_stop_signals
from dlfsd.core.values import FileSpan
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse.errnomap import errno_for

log = logging.getLogger("dlfsd.fuse.wireworker")

HEADER = fw.IN_HEADER.size
WORKER_ABORTED = 3  # exit code: /dev/fuse said ECONNABORTED


class Caller:
    """Who sent the current request (what the Namespace's trace wants: pid, uid)."""

    __slots__ = ("gid", "pid", "uid")

    def __init__(self) -> None:
        self.pid = self.uid = self.gid = 0


class _Stop(Exception):
    """Raised by the signal handler to leave a blocking read of /dev/fuse."""


class Errno(Exception):
    """A handler's answer that is just an errno (ENOSYS and the like)."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.errno = value


def fuse_fds() -> set[int]:
    """This process's descriptors open on /dev/fuse."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.add(int(name))
        except OSError:  # the listing's own descriptor, gone already
            continue
    return found


def find_fuse_fd(before: set[int]) -> int:
    """The /dev/fuse descriptor of our mount: the one not open before mounting."""
    new = fuse_fds() - before
    if len(new) != 1:
        raise RuntimeError(f"cannot tell the mount's /dev/fuse descriptor (candidates {new})")
    return new.pop()


class RequestLoop:
    """Serves requests from `fd` until unmount (ENODEV) or SIGTERM/SIGINT/SIGHUP.

    Subclasses fill `_handlers` (opcode -> handler(nodeid, n) returning the reply
    payload: bytes, None for an empty success, or a FileSpan they send themselves).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.caller = Caller()
        self._buf = bytearray(fw.REQUEST_BUFFER)
        self._view = memoryview(self._buf)
        self._reading = False
        self._stopping = False
        self._aborted = False
        # `dlfs mount --debug`: one line per request and its answer (never otherwise:
        # one attribute test per request is all this costs the hot path).
        self._debug = log.isEnabledFor(logging.DEBUG)
        self._handlers: dict = {}

    # -- the loop ---------------------------------------------------------------------
    def serve(self) -> int:
        """Serve until unmounted or stopped; returns the worker's exit code: 0, or
        WORKER_ABORTED when the connection was aborted (the mount is still there,
        dead: the main process must take it down)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        unblock_stop_signals()  # forked with them blocked (see start_workers)
        try:
            while not self._stopping:
                n = self._receive()
                if n <= 0:
                    break
                self._dispatch(n)
        except _Stop:  # the signal came just as a read returned: we are stopping anyway
            pass
        return WORKER_ABORTED if self._aborted else 0

    def _on_signal(self, signum, frame) -> None:
        self._stopping = True
        if self._reading:  # blocked waiting for a request: nothing is left unanswered
            raise _Stop

    def _receive(self) -> int:
        """Read one request; 0 once the file system is unmounted or we must stop."""
        while True:
            self._reading = True
            try:
                if self._stopping:  # the signal came before _reading was set: it did not
                    return 0  # raise, and readv would wait for the next request
                return os.readv(self.fd, [self._buf])
            except _Stop:
                return 0
            except OSError as err:
                if err.errno == errno.ENODEV:  # unmounted
                    return 0
                if err.errno == errno.ECONNABORTED:  # umount -f, fusectl abort: no crash,
                    self._aborted = True  # but the dead mount must go (see serve)
                    return 0
                if err.errno not in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                    raise  # ENOENT: the request was interrupted before we got it
            finally:
                self._reading = False

    def _dispatch(self, n: int) -> None:
        _, opcode, unique, nodeid, uid, gid, pid, _, _ = fw.IN_HEADER.unpack_from(self._buf)
        if self._debug:
            self._log_request(opcode, unique, nodeid, pid, n)
        if opcode in fw.NO_REPLY:
            return
        caller = self.caller
        caller.pid, caller.uid, caller.gid = pid, uid, gid
        handler = self._handlers.get(opcode)
        try:
            if handler is None:  # a request this file system does not implement
                raise Errno(errno.ENOSYS)
            payload = handler(nodeid, n)
        except Errno as err:
            self._send_error(unique, err.errno)
            return
        except Exception as err:
            self._send_error(unique, errno_for(err, name(opcode)))
            return
        if self._debug:
            log.debug("worker %d: request %d -> %d bytes", os.getpid(), unique,
                      len(payload) if payload is not None else 0)
        if payload is None:
            self._send(fw.error_reply(unique, 0))
        elif type(payload) is FileSpan:
            self._send_span(unique, payload, nodeid, n)
        elif not self._send(fw.reply_header(unique, len(payload)), payload):
            self._reply_lost(opcode)

    def _reply_lost(self, opcode: int) -> None:
        """The kernel did not take a reply (the request was interrupted): undo what
        must not outlive it (nothing, unless a subclass says otherwise)."""

    def _send_span(self, unique: int, span: FileSpan, nodeid: int, n: int) -> None:
        raise NotImplementedError("only dataset workers answer with spans")

    def _log_request(self, opcode: int, unique: int, nodeid: int, pid: int, n: int) -> None:
        detail = ""
        if opcode == fw.LOOKUP:
            detail = f" name {self._name_arg(n)!r}"
        elif opcode in (fw.READ, fw.READDIR, fw.READDIRPLUS):
            fh, offset, size, _ = fw.READ_IN.unpack_from(self._buf, HEADER)
            detail = f" fh {fh} offset {offset} size {size}"
        log.debug("worker %d: request %d %s inode %d from pid %d%s", os.getpid(), unique,
                  name(opcode), nodeid, pid, detail)

    def _send_error(self, unique: int, code: int) -> None:
        if self._debug:
            log.debug("worker %d: request %d -> %s", os.getpid(), unique,
                      errno.errorcode.get(code, code))
        self._send(fw.error_reply(unique, code))

    def _send(self, head: bytes, payload=None) -> bool:
        """Write one reply; False if the kernel no longer wants it (interrupted)."""
        try:
            if payload is None:
                os.write(self.fd, head)
            else:
                os.writev(self.fd, (head, payload))
            return True
        except OSError as err:  # ENOENT: the request was interrupted meanwhile
            if err.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("cannot answer a FUSE request: %s", err)
            return False

    def _name_arg(self, n: int, start: int = HEADER) -> bytes:
        end = self._buf.index(0, start, n)
        return bytes(self._view[start:end])


_OPNAMES = {v: k.lower() for k, v in vars(fw).items() if k.isupper() and isinstance(v, int)
            and not k.startswith(("FOPEN", "BLK", "REQUEST", "FATTR", "FSYNC_", "CKPT"))}


def name(opcode: int) -> str:
    """The request's name for logs and errno_for (`read`, `lookup`, ...)."""
    return _OPNAMES.get(opcode, f"opcode {opcode}")

"""The control socket: how `dlfs trace start|stop|status` reaches a running daemon.

A unix stream socket at `dlfs.runtime.control_socket_path(mountpoint)` (in the
per-user runtime directory, mode 0600), served by a small process of its own
that the daemon forks after its workers (ControlServer). Not a task in the
main process's trio loop: in multi-process mode that process sits in
pyfuse3's read of /dev/fuse, holding the GIL, whenever another process took
the request, so nothing else in it runs until FUSE traffic reaches it. The
control process shares the trace's memory (forked after it was made) and
never serves FUSE. The mount itself stays `ro` for the kernel (a writable
control file would need a read-write mount, and then permission checks, not
EROFS, would answer some writes to datasets). Only root and the daemon's own
user get an answer (SO_PEERCRED, on top of the directory's 0700).

The checkpoint commands (`dlfs flush`, dlfsd.ckpt.control) are also the mount's
`--uid` user's. A root daemon mounting for that user (the Slurm prolog) keeps the
socket above in root's /run/dlfs, which the user cannot reach; it binds a second
one, `dlfs.runtime.user_socket_path(mountpoint)`, owned by that user, 0600, in a
directory only root writes to (UserSocket). The same process answers both; peers
other than root, the daemon's user and the --uid user are refused in one line
(SO_PEERCRED), whichever socket they came through.

Protocol (version 1): the client sends one line, `start`, `stop`, `status`
or `dump`; the daemon answers one JSON line (`{"ok": true, ...}` or
`{"ok": false, "error": "..."}`). After the JSON line of `dump` follow
exactly `record_count` records as raw bytes in the numpy dtype `dtype` the
header gives (see docs/TRACE.md); the header's `paths` maps [dataset, row]
of every file in the records to its path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import struct
import time
from collections.abc import Collection

import numpy as np

from dlfs.errors import DlfsError
from dlfs.runtime import USER_SOCKET_DIR, make_user_socket_dir
from dlfs.signals import stop_signals_blocked, unblock_stop_signals
from dlfsd.base.lineage import die_with_parent, parent_alive
from dlfsd.obs.observe import Observability
from dlfsd.obs.stats import SOURCE_NAMES
from dlfsd.obs.trace import OP_NAMES, TRACE_FORMAT_VERSION

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
REQUEST_TIMEOUT = 10.0
REFUSAL_TIMEOUT = 1.0  # how long a refused peer's request is waited for
_MAX_REQUEST = 8192  # a flush names a path (hex)


class ControlServer:
    """The control socket and the process answering it (main daemon process side)."""

    def __init__(self, path: str, observe: Observability, services: tuple = (),
                 ckpt=None, ckpt_uid: int | None = None) -> None:
        """`services`: more sockets this process answers (each with a bound listening
        `sock`, `start()`, `handle(conn)`, `stop()` and `close()`, e.g. the look-ahead's
        dlfsd.core.ordersock.OrderService); started in the control process."""
        self.path = path
        self.observe = observe
        self.services = list(services)
        # `dlfs flush` (dlfsd.ckpt.control): also answered for the mount's --uid user
        self.ckpt, self.ckpt_uid = ckpt, ckpt_uid
        self.pid = 0
        self._inode = 0  # of the socket we bound: a later daemon's socket is not ours

    def start(self, close_in_child: Collection[int] = ()) -> ControlServer:
        """Bind now (ready before `dlfs mount` returns), answer in a forked process.
        Services whose socket could not be bound are left out.

        `close_in_child`: descriptors the control process must not keep, the mount's
        /dev/fuse above all: it never serves FUSE, and while any process holds that
        descriptor the kernel keeps the connection up, so a mount whose daemon was
        killed would not end (readers would wait instead of getting ENOTCONN)."""
        self.services = [s for s in self.services if s.sock is not None]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)
            self._inode = os.stat(self.path).st_ino
            sock.listen(8)
        except OSError as err:
            sock.close()
            log.error("no trace control (cannot listen on %s: %s)", self.path,
                      err.strerror or err)
            return self
        user = self._user_socket()
        if user is not None:
            self.services.append(user)
        parent = os.getpid()
        with stop_signals_blocked():  # a SIGTERM before SIG_DFL is in must still end it
            pid = os.fork()
            if pid == 0:
                _child(sock, self.observe, parent, close_in_child, self.services,
                       (self.ckpt, self.ckpt_uid))
        sock.close()
        for service in self.services:
            service.close()  # the control process answers it
        self.pid = pid
        return self

    def _user_socket(self) -> UserSocket | None:
        """The --uid user's socket, for a root daemon with a checkpoint tier mounting for
        another user (None otherwise, or if it cannot be made: logged)."""
        if self.ckpt is None or self.ckpt_uid in (None, os.geteuid()) or os.geteuid() != 0:
            return None
        # The main socket is named KEY.sock, KEY the mountpoint's (dlfs.runtime): the
        # user's socket has the same name in USER_SOCKET_DIR (user_socket_path).
        service = UserSocket(str(USER_SOCKET_DIR / os.path.basename(self.path)),
                             self.observe, self.ckpt, self.ckpt_uid)
        return service if service.bind() else None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the control process and remove the socket."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while not os.waitpid(self.pid, os.WNOHANG)[0]:
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    break
                time.sleep(0.01)
            self.pid = 0
        with contextlib.suppress(OSError):
            if self._inode and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        for service in self.services:
            if isinstance(service, UserSocket):
                service.remove()


class UserSocket:
    """The mount's --uid user's way to `dlfs flush` a root daemon's mount (see the module
    doc). A service of the control process (the `services` protocol of ControlServer):
    bound in the main process, answered in the control process."""

    def __init__(self, path: str, observe: Observability, ckpt, uid: int) -> None:
        self.path, self.observe, self.ckpt, self.uid = path, observe, ckpt, uid
        self.sock: socket.socket | None = None
        self._inode = 0

    def bind(self) -> bool:
        """Bind, give the socket to the user (0600), then listen: nobody else can connect
        even before SO_PEERCRED is looked at. False (logged) if that fails: root can
        still flush through the main socket."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            make_user_socket_dir()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # a killed daemon's
            sock.bind(self.path)
            os.chown(self.path, self.uid, -1)
            os.chmod(self.path, 0o600)
            self._inode = os.stat(self.path).st_ino
            sock.listen(8)
        except (OSError, DlfsError) as err:
            sock.close()
            log.warning("the mount's user (uid %d) cannot run `dlfs flush` (root can): no "
                        "socket %s (%s)", self.uid, self.path,
                        getattr(err, "strerror", None) or err)
            self.remove()
            return False
        self.sock = sock
        log.info("the mount's user (uid %d) reaches `dlfs flush` through %s", self.uid,
                 self.path)
        return True

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def remove(self) -> None:
        """Remove the socket file if it is still the one we bound."""
        with contextlib.suppress(OSError):
            if self._inode and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)

    def handle(self, conn: socket.socket) -> None:
        uid = _peer_uid(conn)
        if uid not in (0, os.getuid(), self.uid):
            # Its request is read (briefly: it may not hold the one-at-a-time control
            # process) so that the answer, not a broken pipe, is what it gets.
            conn.settimeout(REFUSAL_TIMEOUT)
            with contextlib.suppress(OSError):
                _read_line(conn)
            _reply(conn, {"ok": False, "error": _ckpt_refusal(uid, self.uid)})
            return
        _handle(conn, self.observe, self.ckpt, self.uid)


def _ckpt_refusal(uid: int, ckpt_uid: int | None) -> str:
    who = f"root, the daemon's user (uid {os.getuid()})" + (
        f" and the mount's user (uid {ckpt_uid})" if ckpt_uid is not None else "")
    return f"permission denied: only {who} may flush this mount's checkpoints, not uid {uid}"


def _child(sock: socket.socket, observe: Observability, parent: int,
           close: Collection[int], services: list, ckpt: tuple = (None, None)) -> None:
    """The control process: answer until SIGTERM from the main process, or until that
    process dies (the kernel then sends the SIGTERM: dlfsd.base.lineage). Ctrl-C and a
    terminal's hangup reach the whole process group; the main process acts on them
    and stops this one."""
    code = 0
    try:
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        alive = die_with_parent(parent)
        unblock_stop_signals()  # forked with them blocked (see ControlServer.start)
        if alive:
            for service in services:
                service.start()
            _serve(sock, observe, parent, services, ckpt)
    except BaseException:
        log.exception("trace control process failed")
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


def _serve(sock: socket.socket, observe: Observability, parent: int, services: list,
           ckpt: tuple = (None, None)) -> None:
    """Answer one connection at a time until SIGTERM, or until the main process `parent`
    is gone (its death signal ends us at once; looking for a new parent every second
    is the second line of defence)."""
    handlers = {sock.fileno(): (sock, lambda conn: _handle(conn, observe, *ckpt))}
    for service in services:
        handlers[service.sock.fileno()] = (service.sock, service.handle)
    try:
        with selectors.DefaultSelector() as selector:
            for fd in handlers:
                selector.register(fd, selectors.EVENT_READ)
            while parent_alive(parent):
                for key, _ in selector.select(1.0):
                    listener, handle = handlers[key.fd]
                    _answer_one(listener, handle)
    finally:
        for service in services:
            service.stop()


def _answer_one(listener: socket.socket, handle) -> None:
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    with conn:
        conn.settimeout(REQUEST_TIMEOUT)
        try:
            handle(conn)
        except OSError:
            pass  # the client went away or timed out; nothing to clean up
        except Exception:
            log.exception("control request failed")


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _handle(conn: socket.socket, observe: Observability, ckpt=None,
            ckpt_uid: int | None = None) -> None:
    uid = _peer_uid(conn)
    command = _read_line(conn)
    if command.startswith("ckpt-"):
        if uid not in (0, os.getuid(), ckpt_uid):
            _reply(conn, {"ok": False, "error": _ckpt_refusal(uid, ckpt_uid)})
        elif ckpt is None:
            _reply(conn, {"ok": False, "error": "this mount has no checkpoint directory "
                                                "(mount with --ckpt-store)"})
        else:
            try:
                _reply(conn, ckpt.handle(command.split()))
            except (OSError, ValueError) as err:
                _reply(conn, {"ok": False, "error": str(err)})
        return
    if uid not in (0, os.getuid()):
        _reply(conn, {"ok": False, "error": "permission denied: only root and the daemon's "
                                            f"user (uid {os.getuid()}) control the trace"})
        return
    if command == "start":
        try:
            observe.start_trace()
        except ValueError as err:
            _reply(conn, {"ok": False, "error": str(err)})
            return
        log.info("trace started (capacity %d records)", observe.trace.capacity)
    elif command == "stop":
        observe.trace.stop()
        log.info("trace stopped")
    elif command == "dump":
        header, body = _dump(observe)
        conn.settimeout(None)  # a slow reader of a big dump is not an error
        _reply(conn, header)
        conn.sendall(body)
        return
    elif command != "status":
        _reply(conn, {"ok": False, "error": f"unknown command {command!r} "
                                            "(start, stop, status, dump)"})
        return
    _reply(conn, {"ok": True, **observe.trace_status()})


def _read_line(conn: socket.socket) -> str:
    data = b""
    while b"\n" not in data and len(data) < _MAX_REQUEST:
        chunk = conn.recv(_MAX_REQUEST)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode("ascii", "replace").strip()


def _reply(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _dump(observe: Observability) -> tuple[dict, bytes]:
    """Header and record bytes of the current trace."""
    dump = observe.trace.dump()
    records = dump.records
    files = records[records["dataset"] >= 0]
    keys = np.unique(files["dataset"].astype(np.int64) << 40 | files["row"])
    paths = [[int(k >> 40), int(k & ((1 << 40) - 1)),
              observe.path_of(int(k >> 40), int(k & ((1 << 40) - 1)))] for k in keys]
    header = {
        "ok": True, "format": "dlfs-trace-dump", "version": TRACE_FORMAT_VERSION,
        "protocol": PROTOCOL_VERSION, "tracing": dump.running,
        "record_count": int(records.size), "dropped": dump.dropped,
        "capacity": dump.capacity, "started_ns": dump.started_ns,
        "stopped_ns": dump.stopped_ns, "ops": list(OP_NAMES),
        "sources": list(SOURCE_NAMES),
        "datasets": [d.name for d in observe.datasets],
        "dtype": [list(field) for field in records.dtype.descr], "paths": paths,
    }
    return header, records.tobytes()

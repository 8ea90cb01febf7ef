"""The control socket: how `dlfs trace start|stop|status` reaches a running daemon.

A unix stream socket at `dlfs.runtime.control_socket_path(mountpoint)` (in the
per-user runtime directory, mode 0600), served by the main daemon process.
The mount itself stays `ro` for the kernel (a writable control file would
need a read-write mount, and then permission checks, not EROFS, would answer
some writes to datasets). Only root and the daemon's own user get an answer
(checked with SO_PEERCRED, on top of the directory's 0700).

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
import socket
import struct

import numpy as np
import trio

from dlfsd.observe import Observability
from dlfsd.stats import SOURCE_NAMES
from dlfsd.trace import OP_NAMES, TRACE_FORMAT_VERSION

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
REQUEST_TIMEOUT = 10.0
_MAX_REQUEST = 256


async def serve_control(path: str, observe: Observability) -> None:
    """Answer control requests on `path` until cancelled; removes the socket at the end."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(8)
    except OSError as err:
        sock.close()
        log.error("no trace control (cannot listen on %s: %s)", path, err.strerror or err)
        return
    try:
        await trio.serve_listeners(lambda stream: _handle(stream, observe),
                                   [trio.SocketListener(sock)])
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _peer_uid(stream: trio.SocketStream) -> int:
    creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                     struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


async def _handle(stream: trio.SocketStream, observe: Observability) -> None:
    async with stream:
        try:
            with trio.fail_after(REQUEST_TIMEOUT):
                if _peer_uid(stream) not in (0, os.getuid()):
                    await _reply(stream, {"ok": False, "error": "permission denied: only root "
                                          "and the mount's owner control the trace"})
                    return
                command = await _read_line(stream)
            await _answer(stream, command, observe)
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; nothing to clean up
        except Exception:
            log.exception("control request failed")


async def _read_line(stream: trio.SocketStream) -> str:
    data = b""
    while b"\n" not in data and len(data) < _MAX_REQUEST:
        chunk = await stream.receive_some(_MAX_REQUEST)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode("ascii", "replace").strip()


async def _reply(stream: trio.SocketStream, message: dict) -> None:
    await stream.send_all((json.dumps(message) + "\n").encode())


async def _answer(stream: trio.SocketStream, command: str, observe: Observability) -> None:
    if command == "start":
        try:
            observe.start_trace()
        except ValueError as err:
            await _reply(stream, {"ok": False, "error": str(err)})
            return
        log.info("trace started (capacity %d records)", observe.trace.capacity)
    elif command == "stop":
        observe.trace.stop()
        log.info("trace stopped")
    elif command == "dump":
        header, body = await trio.to_thread.run_sync(_dump, observe)
        await _reply(stream, header)
        await stream.send_all(body)
        return
    elif command != "status":
        await _reply(stream, {"ok": False, "error": f"unknown command {command!r} "
                                                    "(start, stop, status, dump)"})
        return
    await _reply(stream, {"ok": True, **observe.trace_status()})


def _dump(observe: Observability) -> tuple[dict, bytes]:
    """Header and record bytes of the current trace (runs in a thread: paths take time)."""
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

"""Trace files: fetch a trace from a running daemon, write and read the CSV format.

The CSV format (docs/TRACE.md, version 1): a first line
`# dlfs-trace v1 records=N dropped=D capacity=C started_ns=S stopped_ns=T`,
then a header row, then one row per operation, oldest first:

    time_ns,pid,uid,op,dataset,path,offset,size,latency_ns,source

`pandas.read_csv(path, comment="#")` reads it; so does `read_trace_csv` here.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dlfs.errors import DlfsError
from dlfs.runtime import (
    control_socket_path,
    mountpoint_path,
    trusted_user_socket_dir,
    user_socket_path,
)

CSV_VERSION = 1
CKPT_DATASET = -2  # a write into MOUNTPOINT/ckpt/ (row: its inode in the node cache)
COLUMNS = ("time_ns", "pid", "uid", "op", "dataset", "path", "offset", "size", "latency_ns",
           "source")
_TIMEOUT = 600.0  # a dump of a million records with paths takes seconds, not minutes


# -- talking to the daemon ----------------------------------------------------------
_GONE = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR)


def _connect(mountpoint: str) -> socket.socket:
    """A connection to the daemon of `mountpoint`: its control socket in our runtime
    directory (a daemon we started), else the socket a root daemon keeps for the
    mount's --uid user (`dlfs flush` on a Slurm prolog's mount; dlfs.runtime
    USER_SOCKET_DIR), trusted only in a directory only root may write to."""
    canonical = mountpoint_path(mountpoint)
    path = control_socket_path(canonical)
    try:
        return _open(path)
    except OSError as err:
        if err.errno not in _GONE:
            raise DlfsError(f"cannot reach the daemon of {mountpoint}: {err.strerror}") from None
    user_path = user_socket_path(canonical)
    if trusted_user_socket_dir():
        try:
            return _open(user_path)
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EPERM):
                raise DlfsError(f"permission denied: the DLFS daemon of {mountpoint} answers "
                                f"root and the mount's user only (its socket {user_path} is "
                                "not yours)") from None
            if err.errno not in _GONE:
                raise DlfsError(f"cannot reach the daemon of {mountpoint}: "
                                f"{err.strerror}") from None
    raise DlfsError(f"no DLFS daemon of yours serves {mountpoint} (no control socket {path} "
                    f"nor {user_path}; mount it with `dlfs mount` as this user)")


def _open(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_TIMEOUT)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def _request(sock: socket.socket, command: str) -> tuple[dict, bytes]:
    """Send one command; return the JSON reply and whatever bytes followed it."""
    # A daemon that refused and closed first has left its line for us to read.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(command.encode() + b"\n")
    data = b""
    while b"\n" not in data:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise DlfsError("the daemon closed the control connection without answering")
        data += chunk
    line, rest = data.split(b"\n", 1)
    reply = json.loads(line)
    if not reply.get("ok"):
        raise DlfsError(reply.get("error", "the daemon refused the request"))
    return reply, rest


def trace_command(mountpoint: str, command: str) -> dict:
    """`start`, `stop` or `status`; returns the daemon's status reply."""
    with _connect(mountpoint) as sock:
        return _request(sock, command)[0]


@dataclass
class Trace:
    """A trace in memory: numpy columns (records) plus names."""

    records: np.ndarray  # fields: time_ns pid uid op offset size latency_ns + path_id, op_id
    ops: list[str]
    paths: list[str]  # path_id -> "dataset/relative path" ("" for none)
    meta: dict = field(default_factory=dict)


def fetch_trace(mountpoint: str) -> tuple[dict, np.ndarray]:
    """The daemon's current trace: (header, records in the header's dtype)."""
    with _connect(mountpoint) as sock:
        header, body = _request(sock, "dump")
        dtype = np.dtype([tuple(f) for f in header["dtype"]])
        want = header["record_count"] * dtype.itemsize
        chunks, got = [body], len(body)
        while got < want:
            chunk = sock.recv(min(1 << 22, want - got))
            if not chunk:
                raise DlfsError("the trace dump ended early; try again")
            chunks.append(chunk)
            got += len(chunk)
    return header, np.frombuffer(b"".join(chunks), dtype, header["record_count"])


# -- the CSV format -----------------------------------------------------------------
def _sources_text(mask: int, names: list[str]) -> str:
    return "+".join(name for i, name in enumerate(names) if mask >> i & 1)


def write_trace_csv(path: Path, header: dict, records: np.ndarray) -> None:
    """Write a fetched trace as CSV (see module doc); written to a temp name, then renamed."""
    paths = {(ds, row): p for ds, row, p in header["paths"]}
    ops, sources, names = header["ops"], header["sources"], header["datasets"]
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        _write_rows(tmp, header, records, paths, ops, sources, names)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_rows(tmp: Path, header: dict, records: np.ndarray, paths: dict, ops: list,
                sources: list, names: list) -> None:
    with open(tmp, "w", newline="") as f:
        f.write(f"# dlfs-trace v{CSV_VERSION} records={len(records)} "
                f"dropped={header['dropped']} capacity={header['capacity']} "
                f"started_ns={header['started_ns']} stopped_ns={header['stopped_ns']}\n")
        out = csv.writer(f)
        out.writerow(COLUMNS)
        for r in records.tolist():
            time_ns, row, offset, size, latency, pid, uid, ds, op, mask = r
            dataset = names[ds] if ds >= 0 else ("ckpt" if ds == CKPT_DATASET else "")
            out.writerow((time_ns, pid, uid, ops[op], dataset,
                          paths.get((ds, row), "") if ds >= 0 else "", offset, size, latency,
                          _sources_text(mask, sources)))


_META = re.compile(r"(\w+)=(-?\d+)")


def read_trace_csv(path: Path) -> Trace:
    """Load a trace CSV into numpy columns (op and path as small integer ids)."""
    try:
        with open(path, newline="") as f:
            first = f.readline()
            if not first.startswith("# dlfs-trace v"):
                raise DlfsError(f"{path} is not a DLFS trace (write one with `dlfs trace stop`)")
            meta = {k: int(v) for k, v in _META.findall(first)}
            reader = csv.reader(f)
            if tuple(next(reader, ())) != COLUMNS:
                raise DlfsError(f"{path}: unexpected header row (not a version-1 DLFS trace)")
            rows = [row for row in reader if row]  # a trailing blank line is no record
    except OSError as err:
        raise DlfsError(f"cannot read trace {path}: {err.strerror}") from None
    ops: dict[str, int] = {}
    paths: dict[str, int] = {"": 0}
    dtype = np.dtype([("time_ns", "i8"), ("pid", "i4"), ("uid", "i4"), ("op", "i2"),
                      ("path", "i4"), ("offset", "i8"), ("size", "i8"), ("latency_ns", "i8"),
                      ("source", "U16")])
    records = np.empty(len(rows), dtype)
    try:
        for i, (t, pid, uid, op, _ds, p, off, size, lat, src) in enumerate(rows):
            records[i] = (int(t), int(pid), int(uid), ops.setdefault(op, len(ops)),
                          paths.setdefault(p, len(paths)), int(off), int(size), int(lat), src)
    except ValueError as err:
        raise DlfsError(f"{path}: malformed row {i + 3}: {err}") from None
    return Trace(records, list(ops), list(paths), meta)


# -- `dlfs trace` ---------------------------------------------------------------------
def run_trace_command(action: str, mountpoint: str, output: str | None) -> int:
    """`dlfs trace start|stop|status MOUNTPOINT [-o FILE]`; prints one line."""
    if action == "start":
        status = trace_command(mountpoint, "start")
        print(f"tracing {mountpoint} (keeps the newest {status['capacity']:,} records); "
              f"stop with `dlfs trace stop {mountpoint} -o FILE`")
        return 0
    if action == "status":
        s = trace_command(mountpoint, "status")
        state = "tracing" if s["tracing"] else "not tracing"
        print(f"{mountpoint}: {state}; {s['records']:,} records kept, {s['dropped']:,} "
              f"dropped, capacity {s['capacity']:,}")
        return 0
    target = Path(output or time.strftime("dlfs-trace-%Y%m%d-%H%M%S.csv"))
    if target.is_dir():
        raise DlfsError(f"{target} is a directory; give a file name with -o")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise DlfsError(f"cannot write {target}: {parent} is not a writable directory "
                        "(the trace is still running)")
    trace_command(mountpoint, "stop")
    header, records = fetch_trace(mountpoint)
    try:
        write_trace_csv(target, header, records)
    except OSError as err:
        raise DlfsError(f"cannot write {target} ({err.strerror}); the trace is stopped but "
                        f"kept: run `dlfs trace stop {mountpoint} -o FILE` again") from None
    dropped = f" ({header['dropped']:,} older ones dropped)" if header["dropped"] else ""
    print(f"wrote {len(records):,} records{dropped} to {target}")
    return 0

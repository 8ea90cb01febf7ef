"""`dlfs doctor`: check that this node can mount DLFS, one line per check.

Each check returns what it found and, when something is wrong, what to do
about it, so an admin (or a prolog's log) reads the cause directly instead of
a mount failure two layers later. Nothing here changes the system: the cache
dir is probed with a temporary file that is removed at once, the port is bound
and released.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dlfs.errors import DlfsError
from dlfs.sizes import format_size
from dlfs.store.store import Store

OK, WARN, FAIL = "ok", "warn", "FAIL"
LOW_SPACE = 1 << 30  # below this, the cache dir cannot hold even a few chunks


@dataclass(frozen=True)
class Check:
    status: str  # OK, WARN (worth knowing, not fatal) or FAIL
    what: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.what}: {self.detail}"


def check_fuse_device() -> Check:
    if not os.path.exists("/dev/fuse"):
        return Check(FAIL, "/dev/fuse", "missing; load the fuse module (modprobe fuse) or, in a "
                                        "container, pass --device /dev/fuse")
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as err:
        return Check(FAIL, "/dev/fuse", f"cannot open it: {err.strerror}; check its permissions "
                                        "(crw-rw-rw-) or the container's device rules")
    return Check(OK, "/dev/fuse", "opens read-write")


def check_fusermount() -> Check:
    path = shutil.which("fusermount3")
    if path is None:
        return Check(FAIL, "fusermount3", "not on PATH; install the fuse3 package")
    return Check(OK, "fusermount3", path)


def check_allow_other(conf: str = "/etc/fuse.conf") -> Check:
    """Non-root mounts that other users (or root's prolog) must read need user_allow_other."""
    if os.geteuid() == 0:
        return Check(OK, "allow_other", "running as root: not needed")
    try:
        lines = Path(conf).read_text().splitlines()
    except OSError:
        lines = []
    if any(line.split("#", 1)[0].strip() == "user_allow_other" for line in lines):
        return Check(OK, "allow_other", f"user_allow_other is set in {conf}")
    return Check(WARN, "allow_other", f"user_allow_other is not set in {conf}: only you can "
                                      "read your mounts (--allow-other and --uid will fail)")


def check_module(name: str, required: bool, purpose: str) -> Check:
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        if required:
            return Check(FAIL, name, f"cannot import ({err}); reinstall: pip install dlfs")
        return Check(WARN, name, f"not installed (only needed for {purpose}): "
                                 "pip install 'dlfs[mpi]'")
    return Check(OK, name, f"version {getattr(module, '__version__', 'unknown')}")


def check_store(path: str) -> Iterator[Check]:
    """The store is readable and every dataset's manifest loads."""
    store = Store(path)
    try:
        names = store.dataset_names()
    except DlfsError as err:
        yield Check(FAIL, "store", str(err))
        return
    if not names:
        yield Check(FAIL, "store", f"{path} has no datasets (populate one with `dlfs populate`)")
        return
    yield Check(OK, "store", f"{path}: {len(names)} datasets")
    for name in names:
        try:
            d = store.open(name)
        except DlfsError as err:
            yield Check(FAIL, f"dataset {name}", f"{err}; re-populate it")
            continue
        missing = [i for i in range(d.chunk_count) if not d.chunk_path(i).is_file()]
        if missing:
            yield Check(FAIL, f"dataset {name}", f"{len(missing)} of {d.chunk_count} chunk files "
                                                 f"missing (first: {d.chunk_path(missing[0])}); "
                                                 "re-populate it")
        else:
            yield Check(OK, f"dataset {name}", f"{d.stats['files']} files, "
                                               f"{format_size(d.stats['bytes'])}, manifest loads")


def check_cache_dir(path: str) -> Check:
    """Writable (probed with a temp file) and with room, or creatable under its parent."""
    target = Path(path)
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return Check(FAIL, "cache dir", f"{existing} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".dlfs-doctor-"):
            pass
    except OSError as err:
        return Check(FAIL, "cache dir", f"cannot write in {existing}: {err.strerror}")
    st = os.statvfs(existing)
    free = st.f_bavail * st.f_frsize
    where = str(target) if existing == target else f"{target} (would be created in {existing})"
    if free < LOW_SPACE:
        return Check(FAIL, "cache dir", f"{where}: only {format_size(free)} free; free space or "
                                        "point --cache-dir at node-local NVMe")
    return Check(OK, "cache dir", f"{where}: writable, {format_size(free)} free")


def check_port(port: int, host: str = "0.0.0.0") -> Check:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            return Check(FAIL, f"port {port}", f"cannot listen on {host}:{port}: {err.strerror}; "
                                               "another daemon uses it: pick another port base")
    return Check(OK, f"port {port}", "free")


def check_port_range(base: int, span: int) -> Check:
    """The ports DLFS jobs take on this node (--port-base/--port-span, deploy/slurm): how
    many are in use now. A busy range means another service listens in it, or many DLFS
    jobs run here; a job whose port is taken fails its mount."""
    last = min(base + span - 1, 65535)
    taken = []
    for port in range(base, last + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                taken.append(port)
    name = f"ports {base}-{last}"
    if base + span - 1 > 65535:
        return Check(FAIL, name, f"--port-base {base} + --port-span {span} goes past 65535")
    if not taken:
        return Check(OK, name, "all free")
    shown = ", ".join(str(p) for p in taken[:5]) + (", ..." if len(taken) > 5 else "")
    status = WARN if len(taken) * 10 > span else OK
    return Check(status, name, f"{len(taken)} of {span} in use ({shown}): DLFS jobs running "
                               "here, or other services in DLFS's range")


def check_nodes(items: list[str], node: str | None) -> Iterator[Check]:
    """The node list parses, names this node, and this node's peer port is free."""
    from dlfs.cluster.nodes import parse_nodes, select_self

    try:
        nodes = parse_nodes(items)
        me = nodes[select_self(nodes, node)]
    except DlfsError as err:
        yield Check(FAIL, "nodes", str(err))
        return
    count = f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    yield Check(OK, "nodes", f"{count}; this one is {me.name} ({me.host}:{me.port})")
    yield check_port(me.port, me.host)


def check_secret(path: str) -> Check:
    from dlfs.cluster.nodes import load_secret

    try:
        secret = load_secret(path)
    except DlfsError as err:
        return Check(FAIL, "secret file", str(err))
    return Check(OK, "secret file", f"{path}: mode 0600 or stricter, {len(secret)} bytes")


def check_spliced_reads() -> Check:
    """Whether the daemon can splice 1 MiB read replies (dlfsd.fuse.splicer); not fatal."""
    from dlfs.pipes import PIPE_BYTES, describe_pipe_size, usable_pipe_size

    size = usable_pipe_size()
    return Check(OK if size >= PIPE_BYTES else WARN, "spliced reads", describe_pipe_size(size))


def run_checks(store: str | None, cache_dir: str | None, port: int | None,
               nodes: list[str] | None = None, node: str | None = None,
               secret_file: str | None = None, port_span: int = 0) -> list[Check]:
    checks: list[Callable[[], Check]] = [
        check_fuse_device, check_fusermount, check_allow_other, check_spliced_reads,
        lambda: check_module("trio", True, "mounting"),
        lambda: check_module("mpi4py", False, "mpirun populate and launch"),
    ]
    results = [check() for check in checks]
    if store:
        results += list(check_store(store))
    if cache_dir:
        results.append(check_cache_dir(cache_dir))
    if port and port_span > 1:
        results.append(check_port_range(port, port_span))
    elif port:
        results.append(check_port(port))
    if nodes:
        results += list(check_nodes(nodes, node))
    if secret_file:
        results.append(check_secret(secret_file))
    return results


def doctor(store: str | None, cache_dir: str | None, port: int | None,
           nodes: list[str] | None = None, node: str | None = None,
           secret_file: str | None = None, port_span: int = 0) -> int:
    """Print one line per check; exit code 1 if any failed."""
    results = run_checks(store, cache_dir, port, nodes, node, secret_file, port_span)
    for check in results:
        print(check.line())
    failed = sum(check.status == FAIL for check in results)
    print(f"{failed} problems found" if failed else "all checks passed")
    return 1 if failed else 0

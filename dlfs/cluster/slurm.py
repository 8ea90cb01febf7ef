"""What a Slurm job tells DLFS: its nodes, this node, per-job paths, ports and secret.

Pure functions over the job's environment (no subprocess, no pyfuse3), so the
prolog, `dlfs mount --slurm` inside a job step and the tests all compute the
same answers. Facts about what Slurm 22.05 passes (tested, see
deploy/slurm/README.md): the prolog and epilog get `SLURM_NODELIST` (job steps
get `SLURM_JOB_NODELIST`), `SLURMD_NODENAME` names this node. (Which jobs
opt in is decided in deploy/slurm/common.sh, in bash, so jobs that do not ask
never start Python.)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from dlfs.errors import DlfsError, UsageError

MAX_PORT = 65535
_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_PATTERN_CODE = re.compile(r"%(.)")


# -- hostlists -------------------------------------------------------------------
def expand_hostlist(hostlist: str) -> list[str]:
    """`node[1-3,05],gpu07` -> ['node1', 'node2', 'node3', 'node05', 'gpu07'].

    Slurm's compact syntax: items separated by commas outside brackets; each
    bracket holds numbers and ranges whose zero padding is kept; several
    brackets in one item multiply out, the first varying slowest (like
    `scontrol show hostnames`). Order is kept, duplicates are not removed.
    """
    names: list[str] = []
    for item in _split_items(hostlist):
        names.extend(_expand_item(item, hostlist))
    return names


def _split_items(hostlist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise UsageError(f"invalid hostlist {hostlist!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"invalid hostlist {hostlist!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise UsageError(f"invalid hostlist {hostlist!r}: '[' without ']'")
    items.append(hostlist[start:])
    stripped = [item.strip() for item in items]
    if any(not item for item in stripped):
        raise UsageError(f"invalid hostlist {hostlist!r}: empty name")
    return stripped


def _expand_item(item: str, hostlist: str) -> list[str]:
    match = _BRACKET.search(item)
    if match is None:
        if "[" in item or "]" in item or any(c.isspace() for c in item):
            raise UsageError(f"invalid hostlist {hostlist!r}: bad name {item!r}")
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    rests = _expand_item(tail, hostlist) if tail else [""]
    return [head + number + rest
            for number in _expand_ranges(match.group(1), hostlist) for rest in rests]


def _expand_ranges(body: str, hostlist: str) -> list[str]:
    numbers = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise UsageError(f"invalid hostlist {hostlist!r}: bad range {part!r}")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise UsageError(f"invalid hostlist {hostlist!r}: range {part!r} runs backwards")
        width = len(first) if first.startswith("0") else 1
        numbers.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return numbers


# -- the job -------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerNode:
    """One node of the job as the cluster flags name it: NAME=HOST:PORT."""

    name: str
    host: str
    port: int
    alt_ports: tuple[int, ...] = ()  # if `port` is taken on the node (see peer_nodes)

    def spec(self) -> str:
        return f"{self.name}={self.host}:{'/'.join(map(str, (self.port, *self.alt_ports)))}"


@dataclass(frozen=True)
class SlurmJob:
    """The parts of a job's environment DLFS needs."""

    job_id: str
    nodes: tuple[str, ...]  # expanded node list, in Slurm's order
    node: str  # this node
    uid: int | None = None
    gid: int | None = None


def job_from_env(env: Mapping[str, str]) -> SlurmJob:
    """Read the job from a prolog's or a job step's environment; one clear error if not in one."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    node = env.get("SLURMD_NODENAME")
    missing = [name for name, value in (("SLURM_JOB_ID", job_id),
                                        ("SLURM_JOB_NODELIST or SLURM_NODELIST", nodelist),
                                        ("SLURMD_NODENAME", node)) if not value]
    if missing:
        raise UsageError(f"--slurm needs a Slurm job's environment; missing {', '.join(missing)} "
                         "(run it in a prolog or under srun)")
    assert job_id and nodelist and node  # for the type checker
    if not job_id.isdigit():
        raise UsageError(f"SLURM_JOB_ID is not a job id: {job_id!r}")
    nodes = tuple(expand_hostlist(nodelist))
    if node not in nodes:
        raise UsageError(f"this node {node!r} (SLURMD_NODENAME) is not in the job's node list "
                         f"{nodelist!r}")
    return SlurmJob(job_id, nodes, node, _int_or_none(env.get("SLURM_JOB_UID")),
                    _int_or_none(env.get("SLURM_JOB_GID")))


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


#: Nodes sharing one host (simulated nodes) get ports PORT + i; a job's block of ports
#: is this wide then, so jobs in different slots never overlap.
SHARED_HOST_STRIDE = 64
#: A node whose port is taken listens on the job's next slot of the span instead,
#: and the next, this many slots in all (its peers try them in the same order).
PORT_TRIES = 4


def peer_nodes(job: SlurmJob, port_base: int, host_pattern: str = "%n",
               port_span: int = 1) -> list[PeerNode]:
    """NAME=HOST:PORT for every node of the job.

    Several jobs may run on one node at once, each with its own pool, so a job's
    port is not fixed: it is `port_base` + the job's slot, (job id mod slots),
    where `port_span` ports are reserved for DLFS. Every node computes it from the
    job id alone. Slurm job ids are consecutive, so two jobs only collide if
    `port_span` job ids lie between them and both still run; the second daemon then
    fails its mount with one line naming --port-base. Nodes on their own hosts
    (HOST pattern with %n) all listen on the job's one port. Simulated nodes
    sharing a host (a pattern without %n, e.g. 127.0.0.1) listen on the job's
    port + their position in the node list, in slots SHARED_HOST_STRIDE wide.
    `port_span` 1: every job uses `port_base` (+ position): one DLFS job per node.

    A port taken on a node (by anything: a slow-to-exit daemon of an old job, another
    service) must not fail the job. Nodes cannot ask each other in a prolog, so the
    fallback is a rule every node computes alike: after the job's slot come the next
    slots of the span, wrapping around, PORT_TRIES slots in all (`alt_ports`). A node
    listens on the first of its ports it can bind; a peer tries them in that order
    and keeps the first that answers with the job's secret (another job's daemon on
    a port fails the handshake; a port nothing listens on refuses at once).
    """
    shared_host = "%n" not in host_pattern
    stride = SHARED_HOST_STRIDE if shared_host and port_span > 1 else 1
    if shared_host and port_span > 1 and len(job.nodes) > stride:
        raise UsageError(f"{len(job.nodes)} nodes share one host ({host_pattern}); with "
                         f"--port-span at most {stride} can")
    slots = max(1, port_span // stride)
    firsts = [port_base + ((int(job.job_id) + k) % slots) * stride
              for k in range(min(PORT_TRIES, slots))]
    top = port_base + max(port_span, len(job.nodes) if shared_host else 1) - 1
    if port_base < 1 or top > MAX_PORT:
        raise UsageError(f"ports {port_base}-{top} are out of range (lower --port-base or "
                         f"--port-span: the highest port is {MAX_PORT})")
    peers = []
    for i, name in enumerate(job.nodes):
        ports = [first + (i if shared_host else 0) for first in firsts]
        peers.append(PeerNode(name, expand_pattern(host_pattern, job.job_id, name),
                              ports[0], tuple(ports[1:])))
    return peers


def expand_pattern(pattern: str, job_id: str, node: str) -> str:
    """Replace %j (job id), %n (node name) and %% in a path or host pattern.

    Any other % code is an error, so a typo never becomes a literal directory.
    """

    def code(match: re.Match) -> str:
        letter = match.group(1)
        if letter == "j":
            return job_id
        if letter == "n":
            return node
        if letter == "%":
            return "%"
        raise UsageError(f"unknown code %{letter} in {pattern!r} (use %j job id, %n node, %%)")

    trailing = len(pattern) - len(pattern.rstrip("%"))
    if trailing % 2:  # codes pair up from the left: "%%%" is %% then a lone %
        raise UsageError(f"pattern {pattern!r} ends with a lone %")
    return _PATTERN_CODE.sub(code, pattern)


# -- the per-job secret ----------------------------------------------------------------
def derive_job_secret(site_key: bytes, job_id: str) -> str:
    """HMAC-SHA256(site key, job id) as hex: every node of a job derives the same
    secret without talking to the others, and knowing one job's secret tells
    nothing about another's."""
    if len(site_key) < 16:
        raise DlfsError("site key is too short (use at least 16 random bytes, e.g. "
                        "`head -c 32 /dev/urandom > KEYFILE`)")
    return hmac.new(site_key, b"dlfs-job-secret:" + job_id.encode(), hashlib.sha256).hexdigest()


def read_site_key(path: str) -> bytes:
    """The site key file's bytes; refused if others could read it (it signs every job)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise DlfsError(f"site key file not found: {path} (create it: "
                        f"head -c 32 /dev/urandom > {path}; chmod 600 {path})") from None
    except OSError as err:
        raise DlfsError(f"cannot read site key file {path}: {err.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if stat.S_IMODE(os.fstat(f.fileno()).st_mode) & 0o077:
            raise DlfsError(f"site key file {path} is readable by group or others "
                            f"(run chmod 600 {path})")
        return f.read()


def write_secret_file(path: str, secret: str, uid: int | None, gid: int | None) -> None:
    """Write `secret` to `path` mode 0600, owned by uid:gid, atomically (never world-readable
    even for an instant)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        if uid is not None or gid is not None:
            os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
        os.write(fd, secret.encode() + b"\n")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


# -- the per-job checkpoint directory --------------------------------------------------
def split_job_pattern(pattern: str) -> tuple[str, list[str]]:
    """A per-job path pattern -> (its fixed prefix, the components from the first one
    with a % code on). The prefix is the admin's (dlfs.conf); the rest is made per job.
    A pattern without codes: the parent is the prefix, the last name is made."""
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    if not pattern.startswith("/") or not parts or ".." in parts:
        raise UsageError(f"checkpoint dir pattern {pattern!r} must be an absolute path "
                         "without '..' (e.g. /lustre/dlfs-ckpt/%j)")
    first = next((i for i, p in enumerate(parts) if "%" in p), len(parts) - 1)
    return "/" + "/".join(parts[:first]), parts[first:]


def make_job_dir(pattern: str, job_id: str, node: str, uid: int, gid: int) -> str:
    """Create the job's directory of `pattern` (%j, %n) for uid:gid, 0700, and return it.

    Root does this for a job's user, below a prefix that user may be able to write to
    (a PFS directory): by path, `mkdir -p` + `chown` would follow a symlink the user
    planted at any name and hand the link's target to the user. So everything after
    the admin's prefix (resolved once: it is the site's) goes by descriptors: each
    component is made with mkdirat(parent, name, 0700), opened with O_NOFOLLOW and
    O_DIRECTORY (a link or a file there fails), checked by fstat to be owned by root
    (made now, or earlier by a prolog) or by the user, and given to the user by fchown;
    each parent must be owned by root or the user too. Nothing is ever done by path
    below the prefix, so a swap after a check cannot redirect a later call."""
    prefix, parts = split_job_pattern(pattern)
    names = [expand_pattern(part, job_id, node) for part in parts]
    if any(n in ("", ".", "..") or "/" in n for n in names):
        raise UsageError(f"checkpoint dir pattern {pattern!r} expands to a bad name")
    try:
        os.makedirs(prefix, mode=0o755, exist_ok=True)  # the site's own directory
        real = os.path.realpath(prefix)
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise DlfsError(f"cannot open the checkpoint dir prefix {prefix}: {err.strerror}; "
                        "create it (root-owned) or fix DLFS_CKPT_STORE") from None
    path = real
    try:
        _owned_by(fd, path, uid, "its parent")
        for name in names:
            path = os.path.join(path, name)
            child = _make_owned_dir(fd, name, path, uid, gid)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    return path


def _make_owned_dir(parent_fd: int, name: str, path: str, uid: int, gid: int) -> int:
    """mkdirat + openat(O_NOFOLLOW) + fstat + fchown/fchmod: a descriptor of `name` in
    `parent_fd`, a directory of root's or the user's, now the user's and 0700."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent_fd)
    except OSError as err:
        what = "a symlink or not a directory" if err.errno in (errno.ELOOP, errno.ENOTDIR) \
            else err.strerror
        raise DlfsError(f"refusing the checkpoint dir {path}: {what} (remove it; the "
                        "prolog makes it)") from None
    try:
        _owned_by(fd, path, uid, "it")
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _owned_by(fd: int, path: str, uid: int, what: str) -> None:
    owner = os.fstat(fd).st_uid
    if owner not in (0, uid):
        raise DlfsError(f"refusing the checkpoint dir {path}: {what} is owned by uid {owner}, "
                        f"neither root nor the job's user {uid} (remove it, or fix "
                        "DLFS_CKPT_STORE)")

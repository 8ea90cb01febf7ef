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

    def spec(self) -> str:
        return f"{self.name}={self.host}:{self.port}"


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
    """
    shared_host = "%n" not in host_pattern
    stride = SHARED_HOST_STRIDE if shared_host and port_span > 1 else 1
    if shared_host and port_span > 1 and len(job.nodes) > stride:
        raise UsageError(f"{len(job.nodes)} nodes share one host ({host_pattern}); with "
                         f"--port-span at most {stride} can")
    first = port_base + (int(job.job_id) % max(1, port_span // stride)) * stride
    top = port_base + max(port_span, len(job.nodes) if shared_host else 1) - 1
    if port_base < 1 or top > MAX_PORT:
        raise UsageError(f"ports {port_base}-{top} are out of range (lower --port-base or "
                         f"--port-span: the highest port is {MAX_PORT})")
    return [PeerNode(name, expand_pattern(host_pattern, job.job_id, name),
                     first + (i if shared_host else 0))
            for i, name in enumerate(job.nodes)]


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

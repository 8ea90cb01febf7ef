"""The checkpoint connection's start-up: the tier before the fork, its own FUSE
connection on MOUNTPOINT/ckpt after it, and what the main process keeps of it.

Before the workers fork (open_tier): the tier (CACHE_DIR/ckpt/<hash>/), what an
earlier mount left undrained, and the parts every process shares (write
counter, open-files table, the report `.dlfs/metrics` renders), with `ckpt/`
shown in the namespace's root. Once the datasets' workers serve (connect): the
connection mounted (dlfsd.fuse.rawsession), its INIT answered, asking for FUSE
passthrough where it may be had, its workers forked (dlfsd.fuse.ckptworker),
and only then the drain, which needs to know what the kernel granted.
It sits above the FUSE adapters it mounts and forks (tests/test_layering.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from dlfs.config import MountConfig
from dlfs.errors import DlfsError
from dlfs.runtime import ckpt_mount_path
from dlfsd.base.access import admits_others, shown_owner
from dlfsd.base.kernel import INIT_TIMEOUT, kernel_release
from dlfsd.base.nodeids import CKPT_NAME
from dlfsd.ckpt.control import CkptControl
from dlfsd.ckpt.counters import WriteCounter
from dlfsd.ckpt.creds import Creds
from dlfsd.ckpt.drain import Drainer, scan
from dlfsd.ckpt.openfiles import OpenFiles
from dlfsd.ckpt.tier import Tier
from dlfsd.ckpt.tree import CkptTree
from dlfsd.core.namespace import Namespace
from dlfsd.fuse.ckptworker import CkptWorker
from dlfsd.fuse.rawsession import RawSession
from dlfsd.fuse.wireworker import fuse_fds
from dlfsd.obs.sharedjson import SharedJson
from dlfsd.supervise import fork_workers

log = logging.getLogger("dlfsd")


@dataclass(frozen=True)
class CkptConfig:
    """The checkpoint tier's settings and what its connection shows (--ckpt-*, --uid)."""

    mountpoint: str
    cache_dir: str
    store: str  # --ckpt-store
    uid: int | None = None  # --uid: the tier acts as this user, ckpt/ shows it as owner
    gid: int | None = None  # --gid
    allow_other: bool = False
    workers: int = 1  # processes serving the connection, as many as the datasets'
    limit: int = 0  # --ckpt-limit: bytes the local copies may take (0: no limit)
    limit_wait: float = 60.0  # seconds a write waits for room under the limit
    keep: int = 1  # newest checkpoints never evicted
    idle: float = 2.0  # seconds without a write before an unclosed file is drained
    drain_jobs: int = 2
    drain_bandwidth: int = 0  # bytes/s of all drain copies together (0: unpaced)

    @classmethod
    def from_mount(cls, config: MountConfig) -> CkptConfig | None:
        """None without --ckpt-store."""
        if not config.ckpt_store:
            return None
        if config.cache_dir is None:  # `dlfs mount` says so before a daemon starts
            raise DlfsError("--ckpt-store needs --cache-dir (the tier lives in CACHE_DIR/ckpt/)")
        return cls(mountpoint=config.mountpoint, cache_dir=config.cache_dir,
                   store=config.ckpt_store, uid=config.uid, gid=config.gid,
                   allow_other=config.allow_other, workers=config.workers,
                   limit=config.ckpt_limit, limit_wait=config.ckpt_limit_wait,
                   keep=config.ckpt_keep, idle=config.ckpt_idle, drain_jobs=config.drain_jobs,
                   drain_bandwidth=config.drain_bandwidth)

    def creds(self) -> Creds:
        """The credentials the tier acts with: the mount's --uid/--gid user (a root
        daemon mounting for a job; its group defaults to the uid), else the daemon's
        own."""
        if self.uid is None:
            return Creds.none()
        return Creds.for_user(self.uid, self.gid if self.gid is not None else self.uid)


@dataclass
class CkptTier:
    """The checkpoint tier as made before the fork: the workers share its epoch word,
    write counter and open files."""

    config: CkptConfig
    tier: Tier
    tree: CkptTree  # the namespace's ckpt/, which the connection's workers serve
    where: str  # where its connection is mounted (ckpt_mountpoint)
    written: WriteCounter  # bytes written into ckpt/, per process
    shared: SharedJson  # the drain's report, which `.dlfs/metrics` renders in the workers
    open_files: OpenFiles  # ckpt/'s open files: never evicted, never replaced
    control: CkptControl  # `dlfs flush` (the control process)


def open_tier(config: CkptConfig, namespace: Namespace,
              release: contextlib.ExitStack) -> CkptTier:
    """Open the tier, resume what an earlier mount left, and show `ckpt/` in the
    namespace's root (a symlink where the connection is mounted elsewhere)."""
    # Every file operation of the tier runs as the job's user (docs/SECURITY.md)
    tier = Tier(config.cache_dir, config.store, config.creds())
    release.callback(tier.close)
    tier.state.reset_nodes(tier.root_ino)
    undrained = scan(tier)  # resume: files an earlier mount did not drain
    written = WriteCounter(namespace.observe.slot)
    where, link = ckpt_mountpoint(config.mountpoint)
    open_files = OpenFiles(str(tier.root / ".open"))
    tree = CkptTree(tier, written, config.limit_wait, open_files)
    namespace.attach_ckpt(tree, link)
    shared = SharedJson()
    namespace.observe.add_section("ckpt", shared.read)
    log.info("checkpoint directory %s/ckpt%s: written to %s, drained to %s%s",
             config.mountpoint, f" (a symlink to {where})" if link else "", tier.tree,
             tier.store,
             f" ({len(undrained)} files from an earlier mount still to drain)"
             if undrained else "")
    return CkptTier(config, tier, tree, where, written, shared, open_files, CkptControl(tier))


def ckpt_mountpoint(mountpoint: str) -> tuple[str, bytes | None]:
    """Where the checkpoint connection is mounted, and the symlink target MOUNTPOINT/ckpt
    shows (None: it is mounted on MOUNTPOINT/ckpt itself, as a root daemon does; one
    that is not root mounts through fusermount3, which cannot reach inside our mount:
    see dlfs.runtime.ckpt_mount_path)."""
    if os.geteuid() == 0:
        return os.path.join(mountpoint, CKPT_NAME.decode()), None
    where = ckpt_mount_path(mountpoint)
    where.mkdir(mode=0o700, exist_ok=True)
    return str(where), os.fsencode(where)


def connect(ckpt: CkptTier, namespace: Namespace,
            release: contextlib.ExitStack) -> tuple[dict[int, int], CkptConnection]:
    """Mount the checkpoint directory's own connection, answer its INIT (asking for
    passthrough if wanted), fork its workers, and make its drain. Returns the workers
    (pid -> the connection's /dev/fuse descriptor) and the connection."""
    config = ckpt.config
    before = fuse_fds()
    session = RawSession(ckpt.where, *shown_owner(config.uid, config.gid),
                         admits_others(config.allow_other, config.uid))
    try:
        session.mount()
    except OSError as err:
        raise DlfsError(f"cannot mount the checkpoint directory: {err.strerror}") from None
    release.callback(session.unmount)
    wanted, why = passthrough_wanted(config.limit)
    try:
        negotiated = session.answer_init(INIT_TIMEOUT, wanted)
    except (OSError, TimeoutError) as err:
        raise DlfsError(f"cannot start the checkpoint directory {session.mountpoint}: {err}") \
            from None
    if wanted and not negotiated.passthrough:
        why = (f"off (kernel {kernel_release()} does not offer FUSE passthrough; "
               "Linux >= 6.9 with CONFIG_FUSE_PASSTHROUGH does)")
    log.info("checkpoint directory %s: its own FUSE connection (protocol 7.%d), "
             "passthrough %s", session.mountpoint, negotiated.minor, why)
    workers = start_ckpt_workers(ckpt, namespace, session.fd, before, negotiated.passthrough)
    drainer = Drainer(ckpt.tier, config.drain_jobs, config.drain_bandwidth, config.idle,
                      config.limit, config.keep, open_files=ckpt.open_files,
                      passthrough=negotiated.passthrough)
    return workers, CkptConnection(drainer, ckpt.written, ckpt.shared, why)


def start_ckpt_workers(ckpt: CkptTier, namespace: Namespace, ckpt_fd: int,
                       close_fds: set[int], passthrough: bool) -> dict[int, int]:
    """Fork the processes serving the checkpoint connection (dlfsd.fuse.ckptworker):
    as many as the datasets have (a checkpoint save writes from every rank at once;
    with passthrough the bytes never reach them, and they idle in read())."""
    config = ckpt.config
    uid, gid = shown_owner(config.uid, config.gid)

    def serve() -> int:
        for fd in close_fds:  # the datasets' connection is not ours to hold
            with contextlib.suppress(OSError):
                os.close(fd)
        return CkptWorker(namespace, ckpt.tree, ckpt_fd, uid, gid, ckpt.open_files,
                          passthrough).serve()

    return {pid: ckpt_fd for pid in fork_workers(config.workers, serve, config.mountpoint)}


PASSTHROUGH_VAR = "DLFS_CKPT_PASSTHROUGH"  # 0: checkpoint bytes through the daemon


def passthrough_wanted(limit: int) -> tuple[bool, str]:
    """Whether to ask the kernel for FUSE passthrough on the checkpoint connection, and
    why (for the log and status): the kernel then writes and reads checkpoint files'
    local copies itself. It needs CAP_SYS_ADMIN; and --ckpt-limit needs every write to
    pass through the daemon, which makes it wait for room (docs/CKPT.md)."""
    if os.environ.get(PASSTHROUGH_VAR) == "0":
        return False, f"off ({PASSTHROUGH_VAR}=0)"
    if os.geteuid() != 0:
        return False, "off (needs root)"
    if limit:
        return False, "off (--ckpt-limit: writes wait for room in the daemon)"
    return True, "on"


class CkptConnection:
    """The checkpoint connection as the main process keeps it once it is up: the drain
    (its threads start after every fork), the write counter the workers add to, the
    shared report `.dlfs/metrics` renders in the workers, and whether the kernel
    passes checkpoint bytes through."""

    def __init__(self, drainer: Drainer, written: WriteCounter, shared: SharedJson,
                 passthrough: str) -> None:
        """`passthrough`: "on", or "off (why)"."""
        self.drainer = drainer
        self.written = written
        self.shared = shared
        self.passthrough = passthrough

    def report(self) -> dict:
        """The drain's counters for the status file, also published for `.dlfs/metrics`."""
        report = self.drainer.report()
        report["written_bytes"], report["write_requests"] = self.written.totals()
        report["passthrough"] = self.passthrough
        self.shared.publish(report)
        return report

    def start(self) -> None:
        self.drainer.start()

    def stop(self, connection_lost: bool) -> None:
        """Stop the drain; a lost connection first drains what it can (drain_on_loss)."""
        if connection_lost:
            self.drainer.finish(drain_on_loss())
        self.drainer.stop()


DRAIN_ON_LOSS_VAR = "DLFS_CKPT_DRAIN_ON_LOSS"  # seconds; default DRAIN_ON_LOSS
DRAIN_ON_LOSS = 120.0


def drain_on_loss() -> float:
    """How long a daemon whose connection was lost keeps draining checkpoints before it
    exits (the epilog's flush cannot reach it then)."""
    try:
        return max(0.0, float(os.environ.get(DRAIN_ON_LOSS_VAR, DRAIN_ON_LOSS)))
    except ValueError:
        return DRAIN_ON_LOSS

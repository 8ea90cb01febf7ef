"""Large files by FUSE passthrough: whether a mount does it, and what each open means.

Where the daemon may register backing files (root: the ioctl needs CAP_SYS_ADMIN;
Linux >= 6.9 offering FUSE_PASSTHROUGH at INIT) and has a node cache (--cache-dir),
a large file (a quarter chunk or more) whose whole-file copy on the node is verified
(dlfsd.pool.filecopies) is opened with FOPEN_PASSTHROUGH: the kernel then reads that
copy itself, as fast as a local file, and no READ reaches the daemon.

Passthrough needs OPEN, and OPEN is a per-connection choice: a connection whose
workers answer OPEN with ENOSYS (no_open, dlfsd.fuse.wireworker) never sends another,
which is what makes a warm small file cost no request at all. Answering every OPEN
costs a small file an OPEN and a RELEASE round trip each time it is opened, warm or
cold (docs/ARCHITECTURE.md, "Large files by passthrough", has the figures). So it is
decided per mount (`decide`): `--passthrough auto` (the default) answers opens only
when large files hold at least LARGE_BYTES_SHARE of the mounted bytes; `on` whenever
it can, `off` never.

Per open of a large file (`PassthroughOpens.opened`, any worker): the kernel allows
one backing file per FUSE inode at a time, and no passthrough open of an inode while
it is open through its page cache, nor the other way round (the open fails with EIO).
So every open of a large file is counted in a table shared by the workers (made
before the fork), under a per-file record lock: the first open of a file decides its
mode (passthrough with the copy's backing id if the copy is verified and unchanged;
else served by the daemon, and the copy is demanded from the stager), the later
opens take the same mode and id until the last RELEASE, which closes the id.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dlfs.errors import DlfsError
from dlfs.store.store import Dataset
from dlfsd.obs.stats import Stats
from dlfsd.pool.filecopies import (
    FILE_DEMAND,
    FileCopies,
    FileStager,
    large_share,
    owned_large_rows,
)

if TYPE_CHECKING:
    from dlfsd.core.namespace import Namespace
    from dlfsd.pool.pool import ChunkPool

log = logging.getLogger(__name__)

LARGE_BYTES_SHARE = 0.5  # auto: passthrough when large files hold this share of the bytes
SETTINGS = ("auto", "on", "off")

# Per large file, shared: opens counted now, their backing id (0: served by the daemon),
# totals of opens passed through and served (for status), and the file behind the
# backing id (device, inode): a copy made again while the old one is still open through
# passthrough is another file, which later opens must not mix with the old one.
_SLOT = np.dtype([("opens", "<u4"), ("backing", "<i4"), ("passed", "<u8"), ("served", "<u8"),
                  ("dev", "<u8"), ("ino", "<u8")])


class PassthroughError(DlfsError):
    """A large file's copy changed while the kernel reads it through passthrough: the
    open is refused (EIO) rather than served from the changed copy or mixed with it."""

    errno = errno.EIO


def decide(setting: str, euid: int, pooled: bool,
           datasets: list[Dataset]) -> tuple[bool, str]:
    """Whether the mount asks for passthrough (answering every OPEN), and why, before
    INIT (the kernel's offer is checked after it: `granted`)."""
    if setting == "off":
        return False, "off (--passthrough off)"
    if euid != 0:
        return False, "off (needs root: registering backing files needs CAP_SYS_ADMIN)"
    if not pooled:
        return False, "off (needs --cache-dir: the kernel reads whole-file copies there)"
    share = large_share(datasets)
    if share == 0:
        return False, "off (no large files: none of a quarter chunk and 1 MiB or more)"
    if setting == "auto" and share < LARGE_BYTES_SHARE:
        return False, (f"off (auto: large files hold {share:.0%} of the bytes, under "
                       f"{LARGE_BYTES_SHARE:.0%}; answering every open would cost each "
                       "small file a round trip; --passthrough on forces it)")
    return True, f"on (large files hold {share:.0%} of the bytes)"


def planned_copy_bytes(setting: str, datasets: list[Dataset], owned: list[np.ndarray]) -> int:
    """The bytes of whole-file copies this node will keep if the mount serves large files
    by passthrough (what --node-cache-limit must leave room for, besides the chunks)."""
    if not decide(setting, os.geteuid(), True, datasets)[0]:
        return 0
    return sum(int(d.directory.arrays["size"][owned_large_rows(d, mask)].sum())
               for d, mask in zip(datasets, owned, strict=True))


def granted(wanted: bool, why: str, kernel_grants: bool, release: str) -> tuple[bool, str]:
    """The decision once the kernel answered INIT."""
    if wanted and not kernel_grants:
        return False, (f"off (kernel {release} does not offer FUSE passthrough; Linux >= "
                       "6.9 with CONFIG_FUSE_PASSTHROUGH does)")
    return wanted, why


def file_copies(pool: ChunkPool, datasets: list[Dataset], store_rate: int) -> list[
        FileCopies | None]:
    """Each dataset's whole-file copies on this node (None: it has no large file here);
    adopts what an earlier mount left. Before the fork."""
    out: list[FileCopies | None] = []
    for ds, dataset in enumerate(datasets):
        copies = FileCopies(pool.caches[ds], pool.owned[ds], store_rate)
        if not len(copies):
            copies.close()
            out.append(None)
            continue
        adopted = copies.scan()
        if adopted:
            log.info("dataset %s: %d whole-file copies from an earlier mount, checked "
                     "before their first passthrough", dataset.name, adopted)
        out.append(copies)
    return out


class PassthroughOpens:
    """What an open of a large file means, for every worker of one mount (made before
    the fork): a backing id (passthrough) or 0 (served by the daemon)."""

    def __init__(self, namespace: Namespace, copies: list[FileCopies | None],
                 demand: Callable[[int, int], None]) -> None:
        """`demand(ds, chunk)`: the pool's DemandChannel.send."""
        self.copies = copies
        self.demand = demand
        # inode -> (dataset, its copies, file, table slot)
        self._where: dict[int, tuple[int, FileCopies, int, int]] = {}
        slot = 0
        for ds, c in enumerate(copies):
            if c is None:
                continue
            base = namespace.inode_of(ds, 0)
            for i, row in enumerate(c.rows.tolist()):
                self._where[base + row] = (ds, c, i, slot + i)
            slot += len(c)
        self._map = mmap.mmap(-1, max(1, slot) * _SLOT.itemsize)  # shared: one table
        self._table = np.frombuffer(self._map, dtype=_SLOT)[:slot]
        self._locks = os.memfd_create("dlfs-passthrough", os.MFD_CLOEXEC)  # record locks
        self._refused_warned = False

    def is_large(self, ino: int) -> bool:
        return ino in self._where

    def opened(self, ino: int, register: Callable[[int], int]) -> int:
        """An open of `ino` (its answer not sent yet): its backing id (> 0: passthrough),
        0 (served by the daemon), or -1 (not a large file this node copies: served, not
        counted). `register(fd)` makes a backing id of the copy open as `fd` (the
        adapter's ioctl; 0 if the kernel refuses). Raises PassthroughError if the copy
        changed while opens of it pass through."""
        where = self._where.get(ino)
        if where is None:
            return -1
        ds, c, i, slot = where
        entry = self._table[slot : slot + 1]
        self._lock(slot)
        try:
            opens, backing = int(entry["opens"][0]), int(entry["backing"][0])
            if opens and not backing:  # open through the page cache: stay so
                entry["opens"] += 1
                entry["served"] += 1
                return 0
            fd = c.open_verified(i)
            if fd < 0:
                self.demand(ds, FILE_DEMAND | i)  # make (or check) the copy
                if opens:  # the kernel reads the copy it was given: it changed
                    self._refuse(c, i)
                entry["opens"] = 1
                entry["served"] += 1
                return 0
            try:
                st = os.fstat(fd)
                if opens and (int(entry["dev"][0]), int(entry["ino"][0])) != (st.st_dev,
                                                                              st.st_ino):
                    self._refuse(c, i)  # the kernel reads a copy that has been replaced
                if not opens:
                    backing = register(fd)
            finally:
                os.close(fd)
            entry["opens"] += 1
            entry["backing"] = backing
            entry["dev"], entry["ino"] = st.st_dev, st.st_ino
            entry["passed" if backing else "served"] += 1
            return backing
        finally:
            self._unlock(slot)

    def _refuse(self, c: FileCopies, i: int) -> None:
        if not self._refused_warned:
            self._refused_warned = True
            log.error("whole-file copy %s changed (or was made again) while open through "
                      "passthrough: further opens of it fail (EIO) until those close",
                      c.path(i))
        raise PassthroughError(f"whole-file copy {c.path(i)} changed while open")

    def released(self, ino: int, unregister: Callable[[int], None]) -> None:
        """The kernel closed an open of `ino` (or its OPEN answer was lost): the last one
        closes the backing id."""
        where = self._where.get(ino)
        if where is None:
            return
        slot = where[3]
        entry = self._table[slot : slot + 1]
        self._lock(slot)
        try:
            opens = int(entry["opens"][0])
            if not opens:
                return
            entry["opens"] = opens - 1
            backing = int(entry["backing"][0])
            if opens == 1 and backing:
                entry["backing"] = 0
                unregister(backing)
        finally:
            self._unlock(slot)

    def _lock(self, slot: int) -> None:
        fcntl.lockf(self._locks, fcntl.LOCK_EX, 1, slot)

    def _unlock(self, slot: int) -> None:
        fcntl.lockf(self._locks, fcntl.LOCK_UN, 1, slot)

    def report(self) -> dict:
        """For the status file: the copies and the opens so far."""
        files = verified = unverified = nbytes = 0
        for c in self.copies:
            if c is not None:
                n, v, u, b = c.counts()
                files, verified, unverified, nbytes = (files + n, verified + v,
                                                       unverified + u, nbytes + b)
        table = self._table
        return {"large_files": files, "large_bytes": nbytes, "verified_copies": verified,
                "unverified_copies": unverified,
                "open_now": int(np.count_nonzero(table["opens"])),
                "passthrough_now": int(np.count_nonzero(table["backing"] > 0)),
                "opens_passed": int(table["passed"].sum()),
                "opens_served": int(table["served"].sum())}

    def close(self) -> None:
        del self._table
        with contextlib.suppress(BufferError):  # a view a traceback still holds: GC's
            self._map.close()
        os.close(self._locks)
        for c in self.copies:
            if c is not None:
                c.close()


class MountPassthrough:
    """One mount's passthrough: the decision (logged once, shown by `dlfs status`), and
    where it is on, the whole-file copies, their stager and the open table."""

    def __init__(self, wanted: bool, why: str, opens: PassthroughOpens | None = None,
                 stager=None, namespace: Namespace | None = None) -> None:
        self.wanted, self.why = wanted, why
        self.opens = opens
        self._stager = stager
        self._namespace = namespace

    @classmethod
    def prepare(cls, setting: str, pool: ChunkPool | None, namespace: Namespace, stager,
                store_rate: int) -> MountPassthrough:
        """Decide before INIT; where wanted, make the copies' shared state and the open
        table (before the fork) and give the stager the copies to make."""
        wanted, why = decide(setting, os.geteuid(), pool is not None, namespace.datasets)
        if not wanted or pool is None:
            return cls(False, why)
        copies = file_copies(pool, namespace.datasets, store_rate)
        if not any(c is not None for c in copies):  # every large file is another node's
            return cls(False, "off (no large file's copy is this node's to keep)")
        stager.attach_files(FileStager(copies, stager.fits_file))
        return cls(True, why, PassthroughOpens(namespace, copies, pool.demand.send), stager,
                   namespace)

    def after_init(self, kernel_grants: bool, release: str) -> None:
        """The kernel answered INIT: without passthrough, no copies are made and the
        workers keep no_open."""
        self.wanted, self.why = granted(self.wanted, self.why, kernel_grants, release)
        if not self.wanted and self.opens is not None:
            self._stager.files = None
            self.opens.close()
            self.opens = None
        stats = self._namespace.stats if self._namespace is not None else None
        if self.opens is not None and isinstance(stats, Stats):  # every open answered
            stats.opens_counted = True  # and counted now (before the fork)
        log.info("large files by FUSE passthrough: %s", self.why)

    def report(self) -> dict:
        out: dict = {"mode": self.why}
        if self.opens is not None:
            out.update(self.opens.report())
        return out

    def close(self) -> None:
        if self.opens is not None:
            self.opens.close()
            self.opens = None

"""The FUSE adapter answers with the core's decisions: the policy lives in the Namespace.

One table of requests drives the worker adapter (WireWorker: every request after
INIT) over a Namespace, in this process, without a mount: the worker gets raw
kernel requests (dlfsd.fuse.fusewire layouts) and answers into one end of a
socket pair standing in for /dev/fuse (tests/wirefake.py). Each answer is checked twice: against
the read-only policy (EXPECTED: so that "as the core says" cannot mean "wrong
in both"), and against what the same Namespace call gives directly, mapped
through the one errno table (so that the adapter adds no decision of its own).
The worker is built as on a kernel that sends OPEN and OPENDIR (it answers
them), so that only real answers are compared; the protocol-level ENOSYS of
no_open/no_opendir is the one thing the worker says of its own.

(A pyfuse3 adapter, `--workers 1`, was driven by this table too until that mode
was removed: docs/ARCHITECTURE.md, "One way to serve".)
"""

from __future__ import annotations

import errno
import os
import struct

import pytest
from wirefake import WireSide

from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Store
from dlfsd.core.namespace import CHANGE_REQUESTS, ROOT_INODE, Namespace
from dlfsd.core.values import st_blksize, st_blocks
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse.errnomap import errno_for

MISSING = 10**9  # an inode never given out


@pytest.fixture
def namespace(tmp_path):
    src = tmp_path / "src"
    (src / "dir").mkdir(parents=True)
    (src / "file").write_bytes(b"x" * 10_000)
    (src / "dir" / "inner").write_bytes(b"y" * 10)
    store = Store(tmp_path / "store")
    populate(src, store, "ds", PopulateOptions(chunk_size=4096, jobs=1, fsync=False,
                                               progress=False))
    ns = Namespace([store.open("ds")])
    yield ns
    ns.close()


class Caller:
    pid, uid, gid = os.getpid(), 0, 0


def core_errno(ns: Namespace, call: tuple) -> int:
    """What the Namespace decides for `call` (method name and arguments after the
    inode), as the errno table maps it: 0 if it raises nothing."""
    name, ino, *args = call
    try:
        getattr(ns, name)(ino, *args)
    except Exception as err:
        return errno_for(err, name)
    return 0


@pytest.fixture
def wire(namespace, monkeypatch):
    side = WireSide(namespace, monkeypatch)
    yield side
    side.close()


def inode_of(ns: Namespace, *names: bytes) -> int:
    ino = ROOT_INODE
    for name in names:
        ino = ns.lookup(ino, name)
    return ino


def open_in(flags: int) -> bytes:
    return fw.OPEN_IN.pack(flags, 0)


# (what, the path asked about, the Namespace calls that decide it (each: method and the
#  arguments after the inode), wire opcode and payload, the read-only policy's errno)
TABLE = [
    ("read-only open of a file", ("ds", "file"), [("check_open", 0), ("open", Caller)],
     (fw.OPEN, open_in(0)), 0),
    *[(f"open with {name}", ("ds", "file"), [("check_open", flag), ("open", Caller)],
       (fw.OPEN, open_in(flag)), errno.EROFS)
      for name, flag in [("O_WRONLY", os.O_WRONLY), ("O_RDWR", os.O_RDWR),
                         ("O_TRUNC", os.O_TRUNC), ("O_APPEND", os.O_APPEND),
                         ("O_CREAT", os.O_CREAT)]],
    ("open of a directory", ("ds", "dir"), [("check_open", 0), ("open", Caller)],
     (fw.OPEN, open_in(0)), errno.EISDIR),
    ("open of an unknown inode", None, [("check_open", 0), ("open", Caller)],
     (fw.OPEN, open_in(0)), errno.ENOENT),
    ("opendir of a directory", ("ds", "dir"), [("check_dir",)], (fw.OPENDIR, open_in(0)), 0),
    ("opendir of a file", ("ds", "file"), [("check_dir",)], (fw.OPENDIR, open_in(0)),
     errno.ENOTDIR),
    ("opendir of an unknown inode", None, [("check_dir",)], (fw.OPENDIR, open_in(0)),
     errno.ENOENT),
    ("access R_OK", ("ds", "file"), [("check_access", os.R_OK)],
     (fw.ACCESS, fw.ACCESS_IN.pack(4, 0)), 0),
    ("access W_OK", ("ds", "file"), [("check_access", os.W_OK)],
     (fw.ACCESS, fw.ACCESS_IN.pack(2, 0)), errno.EROFS),
    ("access of an unknown inode", None, [("getattr",), ("check_access", os.R_OK)],
     (fw.ACCESS, fw.ACCESS_IN.pack(4, 0)), errno.ENOENT),
    ("getxattr", ("ds", "file"), [("getxattr", b"user.x")],
     (fw.GETXATTR, fw.SIZE_IN.pack(64, 0) + b"user.x\0"), errno.ENODATA),
    ("getxattr of an unknown inode", None, [("getxattr", b"user.x")],
     (fw.GETXATTR, fw.SIZE_IN.pack(64, 0) + b"user.x\0"), errno.ENOENT),
    ("listxattr", ("ds", "file"), [("listxattr",)], (fw.LISTXATTR, fw.SIZE_IN.pack(0, 0)), 0),
    ("listxattr of an unknown inode", None, [("listxattr",)],
     (fw.LISTXATTR, fw.SIZE_IN.pack(0, 0)), errno.ENOENT),
    ("getattr of an unknown inode", None, [("getattr",)], (fw.GETATTR, b"\0" * 16),
     errno.ENOENT),
    # The kernel never asks this (it knows the mode): no policy, only the agreement.
    ("readlink of a file", ("ds", "file"), [("readlink",)], (fw.READLINK, b""), None),
    ("lookup of a missing name", ("ds",), [("lookup", b"nope")], (fw.LOOKUP, b"nope\0"),
     errno.ENOENT),
]


@pytest.mark.parametrize("what,path,core_calls,wire_call,policy", TABLE,
                         ids=[r[0] for r in TABLE])
def test_the_adapter_answers_what_the_core_decides(namespace, wire, what, path, core_calls,
                                                   wire_call, policy):
    ns = namespace
    ino = MISSING if path is None else inode_of(ns, *(p.encode() for p in path))
    decided = next((e for e in (core_errno(ns, (c[0], ino, *c[1:])) for c in core_calls)
                    if e), 0)
    answered, _ = wire.ask(wire_call[0], ino, wire_call[1])
    assert answered == decided, f"{what}: worker {answered}, core {decided}"
    assert policy is None or decided == policy, f"{what}: {decided}, policy {policy}"


def _name_of(opcode: int) -> str:
    return fw.MUTATING[opcode]


@pytest.mark.parametrize("opcode", sorted(fw.MUTATING), ids=_name_of)
def test_every_change_is_refused(namespace, wire, opcode):
    ino = inode_of(namespace, b"ds", b"file")
    name = fw.MUTATING[opcode]
    assert name in CHANGE_REQUESTS
    assert core_errno(namespace, ("refuse_change", name)) == errno.EROFS
    assert wire.ask(opcode, ino, b"\0" * 64)[0] == errno.EROFS


def test_statfs_numbers_are_the_cores(namespace, wire):
    core = namespace.statfs()
    _, raw = wire.ask(fw.STATFS, ROOT_INODE)
    blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, _ = struct.unpack_from(
        "<QQQQQIIII", raw)
    assert (blocks, bfree, bavail, files, ffree, bsize, namelen, frsize) == (
        core.blocks, core.bfree, core.bavail, core.files, core.ffree, core.bsize,
        core.namemax, core.frsize)
    assert blocks == (10_010 + 4095) // 4096 and bfree == 0  # the datasets' bytes, full


def test_attributes_carry_the_cores_blocks_and_blksize(namespace, wire):
    for path, size in [((b"ds", b"file"), 10_000), ((b"ds", b"dir"), None)]:
        ino = inode_of(namespace, *path)
        attr = namespace.getattr(ino)
        _, raw = wire.ask(fw.GETATTR, ino, b"\0" * 16)
        fields = fw.ATTR_OUT.unpack_from(raw)
        blocks, blksize = fields[5], fields[17]
        assert (blocks, blksize) == (st_blocks(attr.size), st_blksize(attr.mode))
        if size is not None:
            assert blocks == (size + 511) // 512  # 512-byte units, as stat(2) counts

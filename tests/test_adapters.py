"""Both FUSE adapters give the same answers: the policy lives in the Namespace, once.

One table of requests drives the pyfuse3 adapter (DlfsOperations, `--workers 1`)
and the worker adapter (WireWorker, the default) over the same Namespace, in
this process, without a mount: DlfsOperations' handlers are awaited directly,
WireWorker gets raw kernel requests (dlfsd.fuse.fusewire layouts) and answers
into one end of a socket pair standing in for /dev/fuse. The worker is built
as on a kernel that sends OPEN and OPENDIR (it answers them, as the pyfuse3
adapter does), so that only real answers are compared; the protocol-level
ENOSYS of no_open/no_opendir is the one thing the worker says of its own.
"""

from __future__ import annotations

import errno
import os
import socket
import struct

import pyfuse3
import pytest
import trio

from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Store
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse.ops import DlfsOperations
from dlfsd.fuse.wireworker import WireWorker
from dlfsd.kernel import KERNEL_RELEASE_VAR
from dlfsd.namespace import CHANGE_REQUESTS, ROOT_INODE, Namespace

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
    ns = Namespace([store.open("ds")], trio.CapacityLimiter(2))
    yield ns
    ns.close()


class PyfuseSide:
    """Answers from DlfsOperations: 0 or the FUSEError's errno, plus what it returned."""

    def __init__(self, ns: Namespace) -> None:
        self.ops = DlfsOperations(ns)

    async def ask(self, request: str, ino: int, *args):
        try:
            return 0, await getattr(self.ops, request)(ino, *args)
        except pyfuse3.FUSEError as err:
            return err.errno, None


class WireSide:
    """Answers from a WireWorker fed raw requests; replies come back through a socket pair."""

    def __init__(self, ns: Namespace, monkeypatch) -> None:
        monkeypatch.setenv(KERNEL_RELEASE_VAR, "3.10.0")  # sends OPEN and OPENDIR always
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.worker = WireWorker(ns, theirs.fileno(), 0, 0, 1.0, count_opens=True)
        self._theirs = theirs
        self.unique = 0

    def close(self) -> None:
        self.ours.close()
        self._theirs.close()

    def ask(self, opcode: int, ino: int, payload: bytes = b""):
        self.unique += 1
        head = fw.IN_HEADER.pack(fw.IN_HEADER.size + len(payload), opcode, self.unique, ino,
                                 0, 0, os.getpid(), 0, 0)
        request = head + payload
        self.worker._buf[: len(request)] = request
        self.worker._dispatch(len(request))
        reply = self.ours.recv(1 << 20)
        _, error, unique = fw.OUT_HEADER.unpack_from(reply)
        assert unique == self.unique
        return -error, reply[fw.OUT_HEADER.size :]


@pytest.fixture
def sides(namespace, monkeypatch):
    wire = WireSide(namespace, monkeypatch)
    yield PyfuseSide(namespace), wire, namespace
    wire.close()


def inode_of(ns: Namespace, *names: bytes) -> int:
    ino = ROOT_INODE
    for name in names:
        ino = ns.lookup(ino, name)
    return ino


def open_in(flags: int) -> bytes:
    return fw.OPEN_IN.pack(flags, 0)


# (what, the path asked about, pyfuse3 handler and its arguments, wire opcode and payload)
TABLE = [
    ("read-only open of a file", ("ds", "file"), ("open", os.O_RDONLY), (fw.OPEN, open_in(0))),
    *[(f"open with {name}", ("ds", "file"), ("open", flag), (fw.OPEN, open_in(flag)))
      for name, flag in [("O_WRONLY", os.O_WRONLY), ("O_RDWR", os.O_RDWR),
                         ("O_TRUNC", os.O_TRUNC), ("O_APPEND", os.O_APPEND),
                         ("O_CREAT", os.O_CREAT)]],
    ("open of a directory", ("ds", "dir"), ("open", os.O_RDONLY), (fw.OPEN, open_in(0))),
    ("open of an unknown inode", None, ("open", os.O_RDONLY), (fw.OPEN, open_in(0))),
    ("opendir of a directory", ("ds", "dir"), ("opendir",), (fw.OPENDIR, open_in(0))),
    ("opendir of a file", ("ds", "file"), ("opendir",), (fw.OPENDIR, open_in(0))),
    ("opendir of an unknown inode", None, ("opendir",), (fw.OPENDIR, open_in(0))),
    ("access R_OK", ("ds", "file"), ("access", os.R_OK), (fw.ACCESS, fw.ACCESS_IN.pack(4, 0))),
    ("access W_OK", ("ds", "file"), ("access", os.W_OK), (fw.ACCESS, fw.ACCESS_IN.pack(2, 0))),
    ("access of an unknown inode", None, ("access", os.R_OK),
     (fw.ACCESS, fw.ACCESS_IN.pack(4, 0))),
    ("getxattr", ("ds", "file"), ("getxattr", b"user.x"),
     (fw.GETXATTR, fw.SIZE_IN.pack(64, 0) + b"user.x\0")),
    ("getxattr of an unknown inode", None, ("getxattr", b"user.x"),
     (fw.GETXATTR, fw.SIZE_IN.pack(64, 0) + b"user.x\0")),
    ("listxattr", ("ds", "file"), ("listxattr",), (fw.LISTXATTR, fw.SIZE_IN.pack(0, 0))),
    ("listxattr of an unknown inode", None, ("listxattr",),
     (fw.LISTXATTR, fw.SIZE_IN.pack(0, 0))),
    ("getattr of an unknown inode", None, ("getattr",), (fw.GETATTR, b"\0" * 16)),
    ("readlink of a file", ("ds", "file"), ("readlink",), (fw.READLINK, b"")),
    ("lookup of a missing name", ("ds",), ("lookup", b"nope"), (fw.LOOKUP, b"nope\0")),
]


@pytest.mark.parametrize("what,path,pyfuse_call,wire_call", TABLE, ids=[r[0] for r in TABLE])
async def test_both_adapters_answer_alike(sides, what, path, pyfuse_call, wire_call):
    pyfuse, wire, ns = sides
    ino = MISSING if path is None else inode_of(ns, *(p.encode() for p in path))
    pyfuse_errno, _ = await pyfuse.ask(pyfuse_call[0], ino, *pyfuse_call[1:])
    wire_errno, _ = wire.ask(wire_call[0], ino, wire_call[1])
    assert pyfuse_errno == wire_errno, f"{what}: pyfuse3 {pyfuse_errno}, worker {wire_errno}"


EXPECTED = {  # what the core decides, so that "alike" cannot mean "alike wrong"
    "read-only open of a file": 0, "open with O_WRONLY": errno.EROFS,
    "open with O_CREAT": errno.EROFS, "open of a directory": errno.EISDIR,
    "open of an unknown inode": errno.ENOENT, "opendir of a file": errno.ENOTDIR,
    "access W_OK": errno.EROFS, "access R_OK": 0, "getxattr": errno.ENODATA,
    "getxattr of an unknown inode": errno.ENOENT, "listxattr": 0,
    "lookup of a missing name": errno.ENOENT,
}


@pytest.mark.parametrize("what", sorted(EXPECTED))
async def test_the_answers_are_the_read_only_policy(sides, what):
    _, wire, ns = sides
    _, path, _, (opcode, payload) = next(r for r in TABLE if r[0] == what)
    ino = MISSING if path is None else inode_of(ns, *(p.encode() for p in path))
    assert wire.ask(opcode, ino, payload)[0] == EXPECTED[what]


def _name_of(opcode: int) -> str:
    return fw.MUTATING[opcode]


@pytest.mark.parametrize("opcode", sorted(fw.MUTATING), ids=_name_of)
async def test_every_change_is_refused_by_both(sides, opcode):
    pyfuse, wire, ns = sides
    ino = inode_of(ns, b"ds", b"file")
    name = fw.MUTATING[opcode]
    assert name in CHANGE_REQUESTS
    assert wire.ask(opcode, ino, b"\0" * 64)[0] == errno.EROFS
    if hasattr(pyfuse3.Operations, name):
        assert (await pyfuse.ask(name, ino, 0, 0, 0))[0] == errno.EROFS


async def test_statfs_numbers_are_the_same(sides):
    pyfuse, wire, _ = sides
    _, data = await pyfuse.ask("statfs", ROOT_INODE)
    _, raw = wire.ask(fw.STATFS, ROOT_INODE)
    blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, _ = struct.unpack_from(
        "<QQQQQIIII", raw)
    assert (blocks, bfree, bavail, files, ffree, bsize, namelen, frsize) == (
        data.f_blocks, data.f_bfree, data.f_bavail, data.f_files, data.f_ffree,
        data.f_bsize, data.f_namemax, data.f_frsize)
    assert blocks == (10_010 + 4095) // 4096 and bfree == 0  # the datasets' bytes, full


async def test_attributes_carry_the_same_blocks_and_blksize(sides):
    pyfuse, wire, ns = sides
    for path in [(b"ds", b"file"), (b"ds", b"dir")]:
        ino = inode_of(ns, *path)
        _, entry = await pyfuse.ask("getattr", ino)
        _, raw = wire.ask(fw.GETATTR, ino, b"\0" * 16)
        fields = fw.ATTR_OUT.unpack_from(raw)
        blocks, blksize = fields[5], fields[17]
        assert (blocks, blksize) == (entry.st_blocks, entry.st_blksize)

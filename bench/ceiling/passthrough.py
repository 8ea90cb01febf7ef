"""passthrough: a read-only mirror of one flat directory whose files the kernel reads
itself (FUSE passthrough), for bench/fuse_ceiling.py.

Why it exists: it bounds what a FUSE file system can reach when its daemon never
sees the bytes. With `--verify` it first hashes each file whole when it is opened,
before the kernel may read any of it: what passthrough would cost a file system
that, like DLFS, lets no unverified byte reach a reader.

It speaks the FUSE wire protocol over /dev/fuse itself, because libfuse 3.14 and
pyfuse3 cannot ask for passthrough. Needs Linux >= 6.9 (CONFIG_FUSE_PASSTHROUGH)
and CAP_SYS_ADMIN (root). One thread is enough: reads never reach it.

usage: passthrough.py SOURCE_DIR MOUNTPOINT [--verify]
Stays in the foreground; exits when unmounted. Exit 3: the kernel refused passthrough.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import struct
import sys

import xxhash

LOOKUP, FORGET, GETATTR, OPEN, RELEASE, FLUSH, INIT = 1, 2, 3, 14, 18, 25, 26
INTERRUPT, DESTROY, BATCH_FORGET = 36, 38, 42
NO_REPLY = {FORGET, INTERRUPT, BATCH_FORGET}
IN_HEADER = struct.Struct("<IIQQIIIHH")  # fuse_in_header, 40 bytes
OUT_HEADER = struct.Struct("<IiQ")  # fuse_out_header
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
ENTRY_HEAD = struct.Struct("<QQQQII")  # fuse_entry_out before its fuse_attr
ATTR_HEAD = struct.Struct("<QII")  # fuse_attr_out before its fuse_attr
INIT_OUT = struct.Struct("<IIIIHHIIHHII6I")  # fuse_init_out, 64 bytes
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
BACKING_MAP = struct.Struct("<iIQ")  # fuse_backing_map: fd, flags, padding
# _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t)
BACKING_OPEN, BACKING_CLOSE = 0x4010E501, 0x4004E502
FLAGS = 1 | 1 << 5 | 1 << 22 | 1 << 30  # ASYNC_READ, BIG_WRITES, MAX_PAGES, INIT_EXT
FLAGS2_PASSTHROUGH = 1 << (37 - 32)
FOPEN_PASSTHROUGH = 1 << 7
TIMEOUT = 3600
MS_RDONLY = 1


class Mirror:
    """The mirror's state: source files by inode (2 on) and open backing files."""

    def __init__(self, source: str, verify: bool) -> None:
        self.source = source
        self.verify = verify
        self.names = sorted(n for n in os.listdir(source) if not n.startswith("."))
        self.open_files: dict[int, tuple[int, int]] = {}  # fh -> (fd, backing id)
        self.next_fh = 1

    def attr(self, ino: int) -> bytes:
        path = self.source if ino == 1 else os.path.join(self.source, self.names[ino - 2])
        st = os.stat(path)
        t = int(st.st_mtime)
        return ATTR.pack(ino, st.st_size, (st.st_size + 511) // 512, t, t, t, 0, 0, 0,
                         st.st_mode, 1, 0, 0, 0, 4096, 0)

    def lookup(self, name: bytes) -> bytes:
        text = name.rstrip(b"\0").decode(errors="surrogateescape")
        if text not in self.names:
            raise OSError(errno.ENOENT, text)
        ino = self.names.index(text) + 2
        return ENTRY_HEAD.pack(ino, 0, TIMEOUT, TIMEOUT, 0, 0) + self.attr(ino)

    def open(self, dev: int, ino: int) -> bytes:
        if ino == 1:
            raise OSError(errno.EISDIR, "root")
        fd = os.open(os.path.join(self.source, self.names[ino - 2]), os.O_RDONLY)
        try:
            if self.verify:
                hash_whole(fd)
            backing = fcntl.ioctl(dev, BACKING_OPEN, bytearray(BACKING_MAP.pack(fd, 0, 0)), True)
        except BaseException:
            os.close(fd)
            raise
        fh, self.next_fh = self.next_fh, self.next_fh + 1
        self.open_files[fh] = (fd, backing)
        return OPEN_OUT.pack(fh, FOPEN_PASSTHROUGH, backing)

    def release(self, dev: int, fh: int) -> None:
        fd, backing = self.open_files.pop(fh)
        fcntl.ioctl(dev, BACKING_CLOSE, bytearray(struct.pack("<I", backing)), True)
        os.close(fd)


def hash_whole(fd: int) -> int:
    """xxh3-64 of the whole file, read through a sequential mapping (the fastest of the
    ways measured: 8 MiB preads and 2-8 hashing threads were slower on this VM)."""
    if os.fstat(fd).st_size == 0:
        return xxhash.xxh3_64_intdigest(b"")
    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
        m.madvise(mmap.MADV_SEQUENTIAL)
        return xxhash.xxh3_64_intdigest(m)


def mount(dev: int, mountpoint: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={dev},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"passthrough", mountpoint.encode(), b"fuse.passthrough", MS_RDONLY,
                  opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {mountpoint}: {os.strerror(err)}")


def init_reply(buf: bytearray) -> bytes:
    _major, _minor, _readahead, _flags, flags2 = struct.unpack_from("<IIIII", buf, 40)
    if not flags2 & FLAGS2_PASSTHROUGH:
        print("passthrough: the kernel does not offer FUSE passthrough (Linux >= 6.9 with "
              "CONFIG_FUSE_PASSTHROUGH)", file=sys.stderr)
        sys.exit(3)
    return INIT_OUT.pack(7, 40, 8 << 20, FLAGS, 0, 0, 1 << 20, 1, 256, 0,
                         FLAGS2_PASSTHROUGH, 1, *[0] * 6)


def serve(dev: int, mirror: Mirror) -> None:
    buf = bytearray(1 << 21)
    while True:
        try:
            os.readv(dev, [buf])
        except OSError as err:
            if err.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                continue
            return  # ENODEV: unmounted
        length, opcode, unique, nodeid, *_ = IN_HEADER.unpack_from(buf)
        if opcode in NO_REPLY:
            continue
        body, error = b"", 0
        try:
            if opcode == INIT:
                body = init_reply(buf)
            elif opcode == LOOKUP:
                body = mirror.lookup(bytes(buf[IN_HEADER.size : length]))
            elif opcode == GETATTR:
                body = ATTR_HEAD.pack(TIMEOUT, 0, 0) + mirror.attr(nodeid)
            elif opcode == OPEN:
                body = mirror.open(dev, nodeid)
            elif opcode == RELEASE:
                mirror.release(dev, struct.unpack_from("<Q", buf, IN_HEADER.size)[0])
            elif opcode == DESTROY:
                return
            elif opcode != FLUSH:
                error = -errno.ENOSYS
        except OSError as err:
            if opcode == OPEN:
                print(f"passthrough: open: {err}", file=sys.stderr)
            error = -(err.errno or errno.EIO)
        os.write(dev, OUT_HEADER.pack(OUT_HEADER.size + len(body), error, unique) + body)


def main() -> int:
    if len(sys.argv) not in (3, 4) or sys.argv[3:] not in ([], ["--verify"]):
        print(__doc__.split("\n\n")[-2], file=sys.stderr)
        return 2
    mirror = Mirror(sys.argv[1], verify=sys.argv[3:] == ["--verify"])
    dev = os.open("/dev/fuse", os.O_RDWR)
    try:
        mount(dev, sys.argv[2])
    except OSError as err:
        print(f"passthrough: {err.strerror}", file=sys.stderr)
        return 1
    serve(dev, mirror)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The FUSE wire layouts the worker processes write: sizes and fields as the kernel reads them.

The real-mount tests exercise every reply through the kernel; these pin the
layouts (include/uapi/linux/fuse.h) so a mistake shows up as a named field,
not as a confused kernel.
"""

from __future__ import annotations

import os
import stat
import struct

from hypothesis import given
from hypothesis import strategies as st

from dlfsd.base.kernel import kernel_skips_opens, kernel_version
from dlfsd.core.values import Attr, StatFs
from dlfsd.fuse import fusewire as fw


def test_struct_sizes_match_the_kernel_abi():
    assert fw.IN_HEADER.size == 40
    assert fw.OUT_HEADER.size == 16
    assert fw.ENTRY_OUT.size == 128  # fuse_entry_out: 40 + fuse_attr (88)
    assert fw.ATTR_OUT.size == 104  # fuse_attr_out: 16 + fuse_attr
    assert fw.OPEN_OUT.size == 16
    assert fw.STATFS_OUT.size == 80
    assert fw.READ_IN.size == 24  # the fields we use of fuse_read_in


def test_request_buffer_holds_the_largest_request_libfuse_allows():
    """The kernel refuses a /dev/fuse read shorter than max_write plus the WRITE headers
    (80 bytes); libfuse sets max_write to 256 pages, which depends on the page size."""
    assert 256 * os.sysconf("SC_PAGE_SIZE") + 80 <= fw.REQUEST_BUFFER


def test_entry_carries_inode_times_and_timeouts():
    packer = fw.AttrPacker(uid=1234, gid=56, timeout=2.5)
    attr = Attr(ino=4321, mode=stat.S_IFREG | 0o644, size=1000, mtime_ns=-1_500_000_000,
                nlink=1)
    fields = fw.ENTRY_OUT.unpack(packer.entry(attr))
    nodeid, generation, entry_valid, attr_valid, entry_ns, attr_ns = fields[:6]
    assert generation == 0
    ino, size, blocks, atime, mtime, ctime, _, mtime_ns, _, mode, nlink, uid, gid = fields[6:19]
    assert (nodeid, ino, size, blocks) == (4321, 4321, 1000, 2)
    assert (entry_valid, entry_ns, attr_valid, attr_ns) == (2, 500_000_000, 2, 500_000_000)
    assert mtime == atime == ctime == -2 and mtime_ns == 500_000_000  # -1.5 s, normalized
    assert (mode, nlink, uid, gid) == (stat.S_IFREG | 0o644, 1, 1234, 56)


def test_error_reply_is_a_negative_errno():
    length, error, unique = fw.OUT_HEADER.unpack(fw.error_reply(77, 30))
    assert (length, error, unique) == (16, -30, 77)


@given(name=st.binary(min_size=1, max_size=255).filter(lambda b: b"/" not in b and b"\0" not in b),
       ino=st.integers(1, 2**63), offset=st.integers(1, 2**62))
def test_dirent_is_padded_to_eight_bytes(name, ino, offset):
    raw = fw.dirent(name, ino, stat.S_IFDIR | 0o755, offset)
    assert len(raw) % 8 == 0 and len(raw) - (fw.DIRENT.size + len(name)) < 8
    got_ino, got_off, namelen, kind = fw.DIRENT.unpack_from(raw)
    assert (got_ino, got_off, namelen, kind) == (ino, offset, len(name), stat.S_IFDIR >> 12)
    assert raw[fw.DIRENT.size : fw.DIRENT.size + namelen] == name


def test_statfs_packs_the_cores_numbers_in_kernel_order():
    blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, _ = struct.unpack_from(
        "<QQQQQIIII", fw.statfs(StatFs(blocks=3, files=42)))
    assert (blocks, bfree, bavail, files, ffree) == (3, 0, 0, 42, 0)
    assert (bsize, namelen, frsize) == (4096, 255, 4096)


def test_kernel_version_reads_distribution_release_strings():
    assert kernel_version("6.18.0-1-amd64") == (6, 18)
    assert kernel_version("4.18.0-553.el8_10.x86_64") == (4, 18)
    assert kernel_version("3.10.0-1160.el7.x86_64") == (3, 10)
    assert kernel_version("5.1") == (5, 1)
    assert kernel_version("5.4-rc1") == (5, 4)
    assert kernel_version("weird") == (0, 0)  # unknown: assume the old behaviour
    assert kernel_version("6") == (0, 0)


def test_kernels_that_would_pass_enosys_on_get_opens_answered():
    assert kernel_skips_opens("6.18.0-1-amd64") == (True, True)
    assert kernel_skips_opens("4.18.0-553.el8_10.x86_64") == (True, False)
    assert kernel_skips_opens("4.4.0-210-generic") == (True, False)  # 3.15 had no_open
    assert kernel_skips_opens("3.10.0-1160.el7.x86_64") == (False, False)
    assert kernel_skips_opens("garbage") == (False, False)

"""Bulk-packed listings (dlfsd.fuse.listing) equal the one-entry-at-a-time packing, byte for byte.

The reference is dlfsd.fuse.fusewire's per-entry struct packing of the Namespace's
attributes, which the real-mount tests check against `os.stat` of the source.
Trees are random (names of any bytes and lengths, files, directories with
subdirectories, symlinks, mtimes before 1970), and so are the start offset
and the reply size the kernel asks for.
"""

from __future__ import annotations

import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlfs.store.directory import SourceEntry, build_directory
from dlfsd.core.namespace import _attr
from dlfsd.core.values import DIR_BLKSIZE
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse.listing import PLAIN_RECORD, PLUS_RECORD, ListingPacker

BASE = 1024

names = st.binary(min_size=1, max_size=255).filter(lambda b: b"/" not in b and b"\0" not in b
                                                    and b not in (b".", b".."))
kinds = st.sampled_from(["file", "dir", "link"])
entries_of_a_dir = st.dictionaries(names, st.tuples(kinds, st.integers(0, 2**40),
                                                    st.integers(-2**62, 2**62)), max_size=40)


def make_tree(top: dict, sub: dict) -> tuple:
    """Root holding `top`; every directory of `top` holds `sub`."""
    entries = [SourceEntry(b"", stat.S_IFDIR | 0o755, 0, 0)]

    def add(prefix: bytes, children: dict, deeper: dict | None) -> None:
        for name, (kind, size, mtime) in children.items():
            path = prefix + name
            if kind == "dir":
                entries.append(SourceEntry(path, stat.S_IFDIR | 0o750, 0, mtime))
                if deeper is not None:
                    add(path + b"/", deeper, None)
            elif kind == "link":
                entries.append(SourceEntry(path, stat.S_IFLNK | 0o777, 3, mtime, b"abc"))
            else:
                entries.append(SourceEntry(path, stat.S_IFREG | 0o640, size, mtime))

    add(b"", top, sub)
    return build_directory(entries, 1 << 20)


def reference(d, row: int, start: int, size: int, plus: bool, attrs: fw.AttrPacker) -> bytes:
    out, used = [], 0
    kids = d.children(row)
    for off in range(start, len(kids)):
        child = kids[off]
        attr = _attr(d, BASE, child)
        entry = fw.dirent(d.name(child), attr.ino, attr.mode, off + 1)
        if plus:
            entry = attrs.entry(attr) + entry
        if used + len(entry) > size:
            break
        out.append(entry)
        used += len(entry)
    return b"".join(out)


def test_record_layouts_match_the_kernel_abi():
    assert PLUS_RECORD.itemsize == fw.ENTRY_OUT.size + fw.DIRENT.size == 152
    assert PLAIN_RECORD.itemsize == fw.DIRENT.size == 24


@settings(max_examples=150, deadline=None)
@given(top=entries_of_a_dir, sub=entries_of_a_dir, start=st.integers(0, 45),
       size=st.integers(0, 20_000), plus=st.booleans(),
       timeout=st.sampled_from([0.0, 2.5, 86400.0]))
def test_bulk_listing_equals_per_entry_packing(top, sub, start, size, plus, timeout):
    d = make_tree(top, sub)
    attrs = fw.AttrPacker(uid=1000, gid=100, timeout=timeout)
    packer = ListingPacker(d, BASE, attrs)
    for row in range(min(len(d), 5)):  # the root, then some of its children
        assert packer.pack(row, start, size, plus) == reference(d, row, start, size, plus, attrs)


@pytest.mark.parametrize(("request_size", "expected_replies"),
                         [(128 * 1024, 5), (DIR_BLKSIZE, 1)])
def test_a_kernel_sized_request_of_a_large_directory_fills_it_and_resumes_exactly(
        request_size, expected_replies):
    """The kernel asks for replies of the lister's getdents size: 128 KiB, or 1 MiB when
    the directory advertises a 1 MiB block size (glibc sizes its buffer by st_blksize)."""
    top = {f"sample_{i:07d}.bin".encode(): ("file", i * 97, i * 10**9) for i in range(3000)}
    d = make_tree(top, {})
    attrs = fw.AttrPacker(uid=0, gid=0, timeout=86400.0)
    packer = ListingPacker(d, BASE, attrs)
    start, replies = 0, []
    while reply := packer.pack(0, start, request_size, True):
        assert len(reply) <= request_size
        assert reply == reference(d, 0, start, request_size, True, attrs)
        replies.append(reply)
        # the next request starts at the last record's d_off
        *_, last = _offsets(reply)
        start = last
    per_reply = request_size // 176  # each record: 152 bytes + an 18-byte name padded to 24
    assert start == 3000 and len(replies) == -(-3000 // per_reply) == expected_replies


def _offsets(reply: bytes) -> list[int]:
    pos, offs = 0, []
    while pos < len(reply):
        _, off, namelen, _ = fw.DIRENT.unpack_from(reply, pos + fw.ENTRY_OUT.size)
        offs.append(off)
        pos += fw.ENTRY_OUT.size + fw.DIRENT.size + ((namelen + 7) & ~7)
    return offs

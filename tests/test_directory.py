"""SampleDirectory: build + lookup against a plain dict of the same tree."""

from __future__ import annotations

import stat

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlfs.store.directory import SampleDirectory, SourceEntry, build_directory, chunk_lengths

DIR = stat.S_IFDIR | 0o755
names = st.binary(min_size=1, max_size=12).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))


@st.composite
def trees(draw) -> dict[bytes, SourceEntry]:
    """A random tree as {relpath: entry}: dirs, files (incl. empty), symlinks."""
    entries = {b"": SourceEntry(b"", DIR, 0, 1)}
    dirs = [b""]
    for _ in range(draw(st.integers(0, 40))):
        parent = draw(st.sampled_from(dirs))
        name = draw(names)
        path = parent + b"/" + name if parent else name
        if path in entries:
            continue
        kind = draw(st.sampled_from(["dir", "file", "file", "link"]))
        mtime = draw(st.integers(-(10**18), 10**18))
        if kind == "dir":
            entries[path] = SourceEntry(path, DIR, 0, mtime)
            dirs.append(path)
        elif kind == "file":
            mode = stat.S_IFREG | draw(st.sampled_from([0o600, 0o644, 0o755, 0o444]))
            entries[path] = SourceEntry(path, mode, draw(st.integers(0, 30_000)), mtime)
        else:
            target = draw(st.binary(min_size=1, max_size=30))
            entries[path] = SourceEntry(path, stat.S_IFLNK | 0o777, len(target), mtime, target)
    return entries


def _check_matches(d: SampleDirectory, tree: dict[bytes, SourceEntry]) -> None:
    assert len(d) == len(tree)
    for path, entry in tree.items():
        row = d.resolve(path)
        assert row >= 0, path
        assert d.path(row) == path
        assert (d.mode(row), d.mtime_ns(row)) == (entry.mode, entry.mtime_ns)
        if stat.S_ISREG(entry.mode):
            assert d.size(row) == entry.size
            assert sum(d.ext_length_view[e] for e in d.extents(row)) == entry.size
        if entry.link_target is not None:
            assert d.readlink(row) == entry.link_target
        if stat.S_ISDIR(entry.mode):
            prefix = path + b"/" if path else b""
            expected = sorted(p[len(prefix):] for p in tree
                              if p.startswith(prefix) and p != path and b"/" not in p[len(prefix):])
            assert [d.name(c) for c in d.children(row)] == expected
            for child in d.children(row):
                assert d.parent(child) == row
        else:
            assert len(d.children(row)) == 0


@settings(max_examples=150, deadline=None)
@given(tree=trees(), chunk_size=st.sampled_from([4096, 8192, 1 << 20]))
def test_build_and_lookup_match_dict(tree, chunk_size):
    d = build_directory(tree.values(), chunk_size)
    _check_matches(d, tree)


@settings(max_examples=50, deadline=None)
@given(tree=trees(), missing=names)
def test_lookup_of_absent_name_is_minus_one(tree, missing):
    d = build_directory(tree.values(), 4096)
    for path, entry in tree.items():
        if stat.S_ISDIR(entry.mode):
            child = path + b"/" + missing if path else missing
            if child not in tree:
                assert d.lookup(d.resolve(path), missing) == -1


@settings(max_examples=100, deadline=None)
@given(tree=trees(), missing=names, data=st.data())
def test_resolve_many_answers_as_resolve_path_by_path(tree, missing, data):
    """The bulk lookup a sampler's registration uses: every path of the tree, absent
    ones, paths through files and symlinks, and slashes doubled or at the ends."""
    d = build_directory(tree.values(), 4096)
    paths = list(tree) + [p + b"/" + missing if p else missing for p in tree]
    paths += [b"/" + p + b"/" for p in tree] + [p.replace(b"/", b"//") for p in tree]
    paths = data.draw(st.permutations(paths))
    assert d.resolve_many(paths).tolist() == [d.resolve(p) for p in paths]


@settings(max_examples=50, deadline=None)
@given(tree=trees())
def test_manifest_round_trip_preserves_everything(tree):
    d = build_directory(tree.values(), 4096)
    d = d.with_checksums(np.arange(d.extent_count, dtype=np.uint64) * 7919)
    again = SampleDirectory.from_manifest(d.to_manifest())
    assert again.names == d.names and again.links == d.links
    for key, arr in d.arrays.items():
        assert np.array_equal(again.arrays[key], arr), key
    _check_matches(again, tree)


def test_children_of_each_directory_are_contiguous_and_sorted():
    tree = [SourceEntry(b"", DIR, 0, 0), SourceEntry(b"b", DIR, 0, 0), SourceEntry(b"a", DIR, 0, 0),
            SourceEntry(b"a/z", stat.S_IFREG | 0o644, 1, 0),
            SourceEntry(b"a/\xff", stat.S_IFREG | 0o644, 2, 0),
            SourceEntry(b"b/m", stat.S_IFREG | 0o644, 3, 0)]
    d = build_directory(tree, 4096)
    assert [d.path(r) for r in range(len(d))] == [b"", b"a", b"b", b"a/z", b"a/\xff", b"b/m"]
    assert d.arrays["child_start"].tolist() == [1, 3, 5, 6, 6, 6, 6]


def test_multi_extent_file_and_chunk_lengths():
    tree = [SourceEntry(b"", DIR, 0, 0), SourceEntry(b"big", stat.S_IFREG | 0o644, 10_000, 0),
            SourceEntry(b"small", stat.S_IFREG | 0o644, 100, 0)]
    d = build_directory(tree, 4096)
    big = d.resolve(b"big")
    assert [d.ext_length_view[e] for e in d.extents(big)] == [4096, 4096, 1808]
    assert chunk_lengths(d).tolist() == [4096, 4096, 1908]


@pytest.mark.parametrize("bad", [
    [SourceEntry(b"a/b", stat.S_IFREG, 1, 0)],  # missing parent directory
    [SourceEntry(b"f", stat.S_IFREG, 1, 0), SourceEntry(b"f/x", stat.S_IFREG, 1, 0)],
    [SourceEntry(b"x/../y", stat.S_IFREG, 1, 0)],
])
def test_invalid_trees_are_rejected(bad):
    with pytest.raises(ValueError):
        build_directory([SourceEntry(b"", DIR, 0, 0), *bad], 4096)


@pytest.mark.parametrize("jobs", [1, 3])
def test_scan_of_a_real_tree_equals_building_from_its_entries(edge_tree, jobs):
    """The scan lays rows out as it walks (with `jobs` processes listing directories);
    building from an independent walk's entries (os.walk, sorted by build_directory)
    must give the very same arrays."""
    import os

    from dlfs.store.scan import scan_tree

    root = os.fsencode(edge_tree.root)
    entries = [_entry(root, b"")]
    for top, dirs, files in os.walk(root):
        rel_top = os.path.relpath(top, root) if top != root else b""
        for name in dirs + files:
            rel = os.path.join(rel_top, name) if rel_top else name
            entry = _entry(root, rel)
            if entry is not None:
                entries.append(entry)
    expected = build_directory(entries, 4096)
    scanned = scan_tree(edge_tree.root, jobs).directory(4096)
    assert (scanned.names, scanned.links) == (expected.names, expected.links)
    for key, array in expected.arrays.items():
        assert np.array_equal(scanned.arrays[key], array), key


def _entry(root: bytes, rel: bytes) -> SourceEntry | None:
    import os

    st_ = os.lstat(os.path.join(root, rel) if rel else root)
    if stat.S_ISDIR(st_.st_mode):
        return SourceEntry(rel, st_.st_mode, 0, st_.st_mtime_ns)
    if stat.S_ISREG(st_.st_mode):
        return SourceEntry(rel, st_.st_mode, st_.st_size, st_.st_mtime_ns)
    if stat.S_ISLNK(st_.st_mode):
        return SourceEntry(rel, st_.st_mode, st_.st_size, st_.st_mtime_ns,
                           os.readlink(os.path.join(root, rel)))
    return None  # fifos and the like are skipped

"""Populate against a source that changes between the scan and the copy, and the store
operations that replace or remove a dataset.

The source tree is changed between `plan_populate` (the scan) and `write_chunks` (the
copy), the window in which a real tree on a shared file system can change. Nothing is
faked: real files, real symlinks, a real fifo, the library's own calls.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dlfs.errors import DlfsError
from dlfs.progress import byte_progress
from dlfs.store.populate import (
    PopulateOptions,
    plan_populate,
    populate,
    start_temp_dir,
    write_chunks,
)
from dlfs.store.store import Store

OPTIONS = PopulateOptions(chunk_size=64 << 10, jobs=2, progress=False)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "sample.bin").write_bytes(b"harmless bytes!!")
    (src / "big.bin").write_bytes(os.urandom(200 << 10))  # several extents
    return src


def _plan(source: Path, tmp_path: Path):
    plan = plan_populate(source, Store(tmp_path / "store"), "ds", OPTIONS)
    start_temp_dir(plan)
    return plan


def _copy(source: Path, plan) -> None:
    write_chunks(source, plan.tmp, plan.directory, plan.dataset_uuid, OPTIONS)


def test_directory_swapped_for_a_symlink_is_not_followed(source, tmp_path):
    """A user who can write to the tree swaps a directory for a symlink to a file of
    the same name and size elsewhere: populate must not pack the outside bytes."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "sample.bin").write_bytes(b"TOPSECRET bytes!")
    os.utime(secret / "sample.bin", ns=(0, os.stat(source / "d" / "sample.bin").st_mtime_ns))
    plan = _plan(source, tmp_path)
    os.rename(source / "d", tmp_path / "d-moved")
    os.symlink(secret, source / "d")
    with pytest.raises(DlfsError, match="outside its planned place"):
        _copy(source, plan)


def test_file_swapped_for_a_fifo_fails_instead_of_hanging(source, tmp_path):
    plan = _plan(source, tmp_path)
    fifo = source / "d" / "sample.bin"
    fifo.unlink()
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def copy() -> None:
        try:
            _copy(source, plan)
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    worker = threading.Thread(target=copy, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # free the blocked open so the thread ends with the test
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("populate blocked opening a fifo")
    assert isinstance(outcome[0], DlfsError) and "changed while packing" in str(outcome[0])


def test_file_rewritten_in_place_at_the_same_size_is_caught(source, tmp_path):
    plan = _plan(source, tmp_path)
    path = source / "d" / "sample.bin"
    before = os.stat(path).st_mtime_ns
    path.write_bytes(b"other bytes here")  # same length
    os.utime(path, ns=(0, before + 1_000_000_000))
    with pytest.raises(DlfsError, match="changed while packing"):
        _copy(source, plan)


def test_file_grown_keeping_its_mtime_is_caught(source, tmp_path):
    plan = _plan(source, tmp_path)
    path = source / "big.bin"
    before = os.stat(path).st_mtime_ns
    with open(path, "ab") as f:
        f.write(b"more")
    os.utime(path, ns=(0, before))
    with pytest.raises(DlfsError, match=r"changed while packing: .*big\.bin"):
        _copy(source, plan)


def test_directory_deleted_while_packing_is_named(source, tmp_path):
    plan = _plan(source, tmp_path)
    (source / "d" / "sample.bin").unlink()
    (source / "d").rmdir()
    with pytest.raises(DlfsError, match=r"source directory .*/d was deleted while packing"):
        _copy(source, plan)


def test_unchanged_source_packs_with_the_same_checks(source, tmp_path):
    """The checks pass on a stable tree, a source given through a symlink included."""
    link = tmp_path / "src-link"
    link.symlink_to(source)
    dataset = populate(link, Store(tmp_path / "store"), "ds", OPTIONS)
    row = dataset.directory.resolve(b"d/sample.bin")
    assert row >= 0 and dataset.stats["files"] == 2


def test_force_refuses_to_replace_a_directory_that_is_no_dataset(source, tmp_path):
    store = Store(tmp_path / "store")
    notes = store.path / "ds"
    notes.mkdir(parents=True)
    (notes / "important.txt").write_text("keep me")
    options = PopulateOptions(chunk_size=64 << 10, jobs=2, progress=False, force=True)
    with pytest.raises(DlfsError, match="not a DLFS dataset"):
        populate(source, store, "ds", options)
    assert (notes / "important.txt").read_text() == "keep me"
    with pytest.raises(DlfsError, match="not a DLFS dataset"):
        store.remove("ds")
    assert sorted(os.listdir(store.path)) == ["ds"]


def test_force_over_a_linked_dataset_replaces_only_the_link(source, tmp_path):
    elsewhere = Store(tmp_path / "elsewhere")
    populate(source, elsewhere, "ds", OPTIONS)
    store = Store(tmp_path / "store")
    store.path.mkdir()
    (store.path / "ds").symlink_to(elsewhere.path / "ds")
    options = PopulateOptions(chunk_size=64 << 10, jobs=2, progress=False, force=True)
    new = populate(source, store, "ds", options)
    assert not (store.path / "ds").is_symlink()
    assert sorted(os.listdir(store.path)) == ["ds"], "no .old- leftover"
    assert elsewhere.open("ds").uuid != new.uuid  # the linked dataset is untouched


def test_progress_shows_a_path_with_brackets_as_text():
    """Paths are not rich markup: '[/b]' in a source path must not raise."""
    with byte_progress("packing /data/[/b]/v[2]", 10, enabled=True) as advance:
        advance(10)


def _make_deep_tree(root: Path, levels: int, name: bytes) -> list[bytes]:
    """A chain of `levels` directories named `name` under root, a file at the bottom;
    made with *at() calls, since the whole path is longer than PATH_MAX."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        leaf = os.open(b"leaf.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(leaf, b"at the bottom\n")
        os.close(leaf)
    finally:
        os.close(fd)
    return [name] * levels + [b"leaf.bin"]


def _read_by_components(root: Path, parts: list[bytes]) -> bytes:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in parts[:-1]:
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        leaf = os.open(parts[-1], os.O_RDONLY, dir_fd=fd)
        try:
            return os.read(leaf, 1 << 16)
        finally:
            os.close(leaf)
    finally:
        os.close(fd)


def test_a_tree_deeper_than_path_max_packs_and_reads_back(tmp_path, store_with, mounted):
    src = tmp_path / "src"
    src.mkdir()
    parts = _make_deep_tree(src, 40, b"d" * 200)  # ~8 KB of path, twice PATH_MAX
    assert sum(len(p) + 1 for p in parts) > os.pathconf(src, "PC_PATH_MAX")
    m = mounted(store_with(src, "deep"))
    assert _read_by_components(m.path / "deep", parts) == b"at the bottom\n"

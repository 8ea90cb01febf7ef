"""`mpirun -n 3 dlfs populate`: same dataset as a serial populate, or nothing at all.

Real Open MPI runs (`mpirun --allow-run-as-root --oversubscribe`). The parallel
result is compared with the serial `edge_store` array by array, and read back
byte by byte through a real mount. Failures on rank 0 (before any copying)
and on the last rank (a source file that reads EIO, served by a DLFS mount of
a corrupted dataset) must both exit non-zero with one error line and publish
nothing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import DLFS, describe_result, in_ci
from trees import describe_tree, make_small_tree

from dlfs.format import CHUNK_HEADER_SIZE, chunk_path
from dlfs.mpi_populate import chunk_owners, launched_by_mpi
from dlfs.store import Store

RANKS = 3


def require_mpi() -> None:
    problems = []
    if shutil.which("mpirun") is None:
        problems.append("mpirun is not on PATH (install openmpi-bin)")
    if importlib.util.find_spec("mpi4py") is None:
        problems.append("mpi4py is not installed (pip install -e .[mpi])")
    if problems:
        if in_ci():
            pytest.fail("; ".join(problems))
        pytest.skip("; ".join(problems))


def mpirun_populate(*args: str | os.PathLike, ranks: int = RANKS) -> subprocess.CompletedProcess:
    require_mpi()
    env = {k: v for k, v in os.environ.items() if k != "DLFS_READY_FD"}
    return subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(ranks),
                           *DLFS, "populate", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=180)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("dlfs: error:")]


def assert_nothing_published(store: Path, name: str) -> None:
    if store.exists():
        left = [p.name for p in store.iterdir() if p.name == name or p.name.startswith(".")]
        assert left == [], f"left in the store: {left}"


# -- pure parts ---------------------------------------------------------------------
def test_chunk_owners_are_contiguous_and_balanced():
    owners = chunk_owners(np.full(10, 100, dtype=np.uint64), 3)
    assert owners.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert chunk_owners(np.array([100, 100, 5], dtype=np.uint64), 8).max() < 8
    assert chunk_owners(np.zeros(0, dtype=np.uint64), 3).tolist() == []
    assert chunk_owners(np.array([0, 0], dtype=np.uint64), 3).tolist() == [0, 0]
    assert chunk_owners(np.array([7], dtype=np.uint64), 1).tolist() == [0]


@pytest.mark.parametrize(("env", "expected"), [
    ({}, False), ({"OMPI_COMM_WORLD_SIZE": "1"}, False), ({"OMPI_COMM_WORLD_SIZE": "3"}, True),
    ({"PMI_SIZE": "2"}, True), ({"PMIX_SIZE": "4"}, True), ({"PMI_SIZE": "x"}, False)])
def test_launched_by_mpi(env, expected):
    assert launched_by_mpi(env) is expected


# -- real mpirun --------------------------------------------------------------------
@pytest.fixture(scope="module")
def parallel_store(tmp_path_factory, edge_tree) -> Path:
    store = tmp_path_factory.mktemp("mpi") / "store"
    result = mpirun_populate(edge_tree.root, "--store", store, "--name", "edge",
                             "--chunk-size", "256K")
    assert result.returncode == 0, describe_result(result)
    published = [line for line in result.stdout.splitlines() if line.startswith("published")]
    assert len(published) == 1, result.stdout  # rank 0 reports, once
    return store


def test_same_manifest_as_serial(parallel_store, edge_store):
    par, ser = Store(parallel_store).open("edge"), Store(edge_store).open("edge")
    assert par.uuid != ser.uuid
    assert par.stats == ser.stats
    assert par.chunk_lengths.tolist() == ser.chunk_lengths.tolist()
    assert (par.directory.names, par.directory.links) == (ser.directory.names,
                                                          ser.directory.links)
    for key, array in ser.directory.arrays.items():
        assert np.array_equal(par.directory.arrays[key], array), key


def test_every_rank_wrote_chunks(parallel_store):
    d = Store(parallel_store).open("edge")
    owners = chunk_owners(d.chunk_lengths, RANKS)
    assert set(owners.tolist()) == set(range(RANKS))
    for index in range(d.chunk_count):
        assert d.chunk_path(index).stat().st_size == CHUNK_HEADER_SIZE + d.chunk_lengths[index]


def test_verify_passes(parallel_store, dlfs_cli):
    result = dlfs_cli("verify", "--store", parallel_store, "edge")
    assert result.returncode == 0, describe_result(result)


@pytest.mark.usefixtures("daemon_guard")
def test_mount_reads_identical_to_the_source(parallel_store, edge_nodes, mounted):
    m = mounted(parallel_store, "--workers", "2")
    assert describe_tree(m / "edge") == edge_nodes


def test_rank0_failure_publishes_nothing(tmp_path):
    store = tmp_path / "store"
    result = mpirun_populate(tmp_path / "nosuch", "--store", store, "--name", "x")
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 1 and "source not found" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert_nothing_published(store, "x")


def _flip_first_byte(store: Path, name: str, rel: bytes) -> None:
    dataset = Store(store).open(name)
    d = dataset.directory
    ext = d.first_extent(d.resolve(rel))
    with open(chunk_path(dataset.path, d.ext_chunk_view[ext]), "r+b") as f:
        f.seek(CHUNK_HEADER_SIZE + d.ext_offset_view[ext])
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.usefixtures("daemon_guard")
def test_read_error_on_another_rank_publishes_nothing(tmp_path, store_with, mounted):
    """The source is a DLFS mount whose deepest (so last-packed) file reads EIO."""
    src = tmp_path / "src"
    make_small_tree(src, files=30)
    bad = src / "zz" / "zz" / "bad.bin"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(os.urandom(5000))
    corrupt = store_with(src, "ds", "64K")
    _flip_first_byte(corrupt, "ds", b"zz/zz/bad.bin")
    # Same tree and chunk size, so the copy's layout is the corrupt store's.
    d = Store(corrupt).open("ds")
    bad_chunk = d.directory.ext_chunk_view[d.directory.first_extent(d.directory.resolve(
        b"zz/zz/bad.bin"))]
    bad_rank = int(chunk_owners(d.chunk_lengths, RANKS)[bad_chunk])
    assert bad_rank != 0, "the bad file must be packed by a rank other than 0"

    source = mounted(corrupt, "--workers", "1") / "ds"
    store = tmp_path / "out"
    result = mpirun_populate(source, "--store", store, "--name", "copy", "--chunk-size", "64K")
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    assert f"rank {bad_rank} " in lines[0] and "cannot read source file" in lines[0], lines[0]
    assert "zz/zz/bad.bin" in lines[0]
    assert "Traceback" not in result.stderr
    assert_nothing_published(store, "copy")

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
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import DLFS, daemon_pids_for, describe_result, force_unmount, fstype_at, in_ci
from trees import describe_tree, make_small_tree

from dlfs.cluster.mpi_launch import launch_secret_file, node_names
from dlfs.cluster.mpi_populate import chunk_owners, launched_by_mpi
from dlfs.store.format import CHUNK_HEADER_SIZE, chunk_path
from dlfs.store.store import Store

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


def mpirun_dlfs(*args: str | os.PathLike, ranks: int = RANKS, dlfs: list[str] = DLFS,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`mpirun ... -n RANKS dlfs ARGS` (the venv's dlfs), never raising on failure."""
    require_mpi()
    env = {k: v for k, v in os.environ.items() if k != "DLFS_READY_FD"}
    env.update(extra_env or {})
    return subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(ranks),
                           *dlfs, *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=180)


def mpirun_populate(*args: str | os.PathLike) -> subprocess.CompletedProcess:
    return mpirun_dlfs("populate", *args)


# The real `dlfs` CLI with an audit hook that only watches: every file a rank (or a
# process it forked) opens for writing whose name ends in .chunk is appended to
# $DLFS_TEST_WRITES/rank-N, whether by open() (mode "w...") or os.open (write flags).
# What each rank really wrote, seen from outside the code under test.
RECORD_CHUNK_WRITES = """
import os, sys
log = os.path.join(os.environ["DLFS_TEST_WRITES"],
                   "rank-" + (os.environ.get("OMPI_COMM_WORLD_RANK")
                              or os.environ.get("PMIX_RANK", "unknown")))
busy = False

def for_writing(mode, flags):
    if isinstance(mode, str):
        return "w" in mode or "a" in mode or "+" in mode
    return isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR) != 0

def record(event, args):
    global busy
    if busy or event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)) \\
            or not for_writing(args[1], args[2]):
        return
    name = os.path.basename(os.fsdecode(args[0]))
    if name.endswith(".chunk"):
        busy = True  # the log's own open is an "open" event too
        try:
            with open(log, "a") as f:
                f.write(name + "\\n")
        finally:
            busy = False

sys.addaudithook(record)
from dlfs.cli.main import main
sys.exit(main())
"""


def reserve_ports(count: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """`count` consecutive ports nothing uses, each held by a bound socket (close them
    before use): the OS picks the first, so no fixed port that may be busy on CI."""
    for _ in range(100):
        held: list[socket.socket] = []
        try:
            for i in range(count):
                sock = socket.socket()
                held.append(sock)
                sock.bind((host, held[0].getsockname()[1] + i if i else 0))
            return held
        except (OSError, OverflowError):  # taken, or past 65535: another base
            for sock in held:
                sock.close()
    pytest.fail(f"found no {count} consecutive free ports on {host}")


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


def test_node_names_suffix_ranks_only_on_shared_hosts():
    assert node_names(["a", "b", "c"]) == ["a", "b", "c"]
    assert node_names(["a", "a", "b"]) == ["a-0", "a-1", "b"]


# -- real mpirun --------------------------------------------------------------------
@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory, edge_tree) -> tuple[Path, dict[int, list[int]]]:
    """The parallel populate's store, and the chunks each rank opened for writing."""
    base = tmp_path_factory.mktemp("mpi")
    store, writes = base / "store", base / "writes"
    writes.mkdir()
    result = mpirun_dlfs("populate", edge_tree.root, "--store", store, "--name", "edge",
                         "--chunk-size", "256K", dlfs=[sys.executable, "-c", RECORD_CHUNK_WRITES],
                         extra_env={"DLFS_TEST_WRITES": str(writes)})
    assert result.returncode == 0, describe_result(result)
    published = [line for line in result.stdout.splitlines() if line.startswith("published")]
    assert len(published) == 1, result.stdout  # rank 0 reports, once
    assert {p.name for p in writes.iterdir()} <= {f"rank-{r}" for r in range(RANKS)}
    written = {}
    for rank in range(RANKS):
        log = writes / f"rank-{rank}"
        names = log.read_text().split() if log.exists() else []
        # each chunk once, where the rank first opened it (a chunk file may be opened
        # for writing by several of the rank's processes)
        written[rank] = [int(name.removesuffix(".chunk")) for name in dict.fromkeys(names)]
    return store, written


@pytest.fixture(scope="module")
def parallel_store(parallel_run) -> Path:
    return parallel_run[0]


def test_same_manifest_as_serial(parallel_store, edge_store):
    par, ser = Store(parallel_store).open("edge"), Store(edge_store).open("edge")
    assert par.uuid != ser.uuid
    assert par.stats == ser.stats
    assert par.chunk_lengths.tolist() == ser.chunk_lengths.tolist()
    assert (par.directory.names, par.directory.links) == (ser.directory.names,
                                                          ser.directory.links)
    for key, array in ser.directory.arrays.items():
        assert np.array_equal(par.directory.arrays[key], array), key


def test_every_rank_wrote_chunks(parallel_run):
    """What the ranks really wrote: each a share, together every chunk once; the shares
    are contiguous runs in rank order, balanced by bytes (within one chunk)."""
    store, written = parallel_run
    d = Store(store).open("edge")
    lengths = [int(n) for n in d.chunk_lengths]
    assert all(written[rank] for rank in range(RANKS)), f"a rank wrote nothing: {written}"
    everything = [chunk for rank in range(RANKS) for chunk in written[rank]]
    assert sorted(everything) == list(range(d.chunk_count)), "chunks missed or written twice"
    assert everything == list(range(d.chunk_count)), f"not contiguous in rank order: {written}"
    for rank in range(RANKS):
        share = sum(lengths[chunk] for chunk in written[rank])
        assert abs(share - sum(lengths) / RANKS) <= max(lengths), (rank, share, sum(lengths))
    for index in range(d.chunk_count):
        assert d.chunk_path(index).stat().st_size == CHUNK_HEADER_SIZE + lengths[index]


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


# The real `dlfs` CLI, with Ctrl-C arriving on rank 0 after it made the temporary
# directory and before the other ranks have the plan (while it packs the plan to send).
INTERRUPT_BEFORE_THE_PLAN_IS_SHARED = """
import sys
import dlfs.cluster.mpi_populate
def interrupted(plan):
    raise KeyboardInterrupt
dlfs.cluster.mpi_populate._pack_plan = interrupted
from dlfs.cli.main import main
sys.exit(main())
"""


def test_interrupt_before_the_plan_is_shared_leaves_no_temporary_directory(tmp_path):
    src = tmp_path / "src"
    make_small_tree(src)
    store = tmp_path / "store"
    store.mkdir()
    result = mpirun_dlfs("populate", src, "--store", store, "--name", "x",
                         dlfs=[sys.executable, "-c", INTERRUPT_BEFORE_THE_PLAN_IS_SHARED])
    assert result.returncode != 0, result.stdout + result.stderr
    assert error_lines(result) == [] and "interrupted" in result.stderr, result.stderr
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


# -- mpirun dlfs mount --mpi -----------------------------------------------------------

@pytest.fixture
def launch_site(tmp_path, store_with):
    """A store, one mountpoint per rank (named like the ranks' nodes), and a teardown
    that unmounts and kills whatever a failed test left."""
    src = tmp_path / "src"
    make_small_tree(src, files=20)
    (src / "big.bin").write_bytes(os.urandom(600_000))
    store = store_with(src, "ds")
    names = node_names([socket.gethostname().split(".")[0]] * RANKS)
    mounts = [tmp_path / f"mnt-{name}" for name in names]
    for mp in mounts:
        mp.mkdir()
    try:
        yield src, store, names, mounts
    finally:
        for mp in mounts:
            force_unmount(mp)


def _launch(base: Path, store: Path, port: int) -> subprocess.CompletedProcess:
    return mpirun_dlfs("mount", "--mpi", base / "mnt-%n", "--store", store,
                       "--cache-dir", base / "cache-%n", "--log-file", base / "log-%n",
                       "--port-base", str(port), "--node-host", "127.0.0.1", "--workers", "1")


@pytest.mark.usefixtures("daemon_guard")
def test_mpi_launch_brings_up_one_pool_and_tears_it_down(tmp_path, launch_site):
    src, store, names, mounts = launch_site
    ports = reserve_ports(RANKS)
    base = ports[0].getsockname()[1]
    for sock in ports:
        sock.close()
    result = _launch(tmp_path, store, base)
    assert result.returncode == 0, describe_result(result)
    expected = describe_tree(src)
    for name, mp in zip(names, mounts, strict=True):
        assert fstype_at(mp) == "fuse.dlfs", name
        assert describe_tree(mp / "ds") == expected, name
        log = (tmp_path / f"log-{name}").read_text()
        assert f"chunk pool: node {name} of {RANKS}" in log, log
    secret_files = [Path(launch_secret_file(name, os.path.realpath(mp)))
                    for name, mp in zip(names, mounts, strict=True)]
    secrets_ = {path.read_text() for path in secret_files}
    assert len(secrets_) == 1, "every rank must hold the same secret"

    result = mpirun_dlfs("umount", "--mpi", tmp_path / "mnt-%n")
    assert result.returncode == 0, describe_result(result)
    for mp in mounts:
        assert fstype_at(mp) is None and daemon_pids_for(mp) == []
    assert not any(path.exists() for path in secret_files)


@pytest.mark.usefixtures("daemon_guard")
def test_mpi_launch_is_all_or_nothing(tmp_path, launch_site):
    _, store, names, mounts = launch_site
    *free, busy = reserve_ports(RANKS)
    base = free[0].getsockname()[1]
    for sock in free:
        sock.close()
    with busy:  # the last rank's peer port is taken
        busy.listen()
        result = _launch(tmp_path, store, base)
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    assert f"rank {RANKS - 1} ({names[-1]})" in lines[0] and "cannot listen" in lines[0]
    assert "--port-base" in lines[0], lines[0]  # what --mpi users set, not --nodes
    for mp in mounts:
        assert fstype_at(mp) is None, f"{mp} stayed mounted after another rank failed"
        assert daemon_pids_for(mp) == []


@pytest.mark.usefixtures("daemon_guard")
def test_mpi_launch_interrupted_leaves_nothing_running(tmp_path, launch_site):
    """Ctrl-C on mpirun while the last rank still comes up (its log file is a fifo
    nobody opens, like a hung file system): mpirun kills the ranks, those that had
    mounted among them, and their daemons, in sessions of their own, unmount
    themselves. Before, they served on with nobody to stop them."""
    require_mpi()
    _, store, names, mounts = launch_site
    ports = reserve_ports(RANKS)
    base = ports[0].getsockname()[1]
    for sock in ports:
        sock.close()
    os.mkfifo(tmp_path / f"log-{names[-1]}")
    env = {k: v for k, v in os.environ.items() if k != "DLFS_READY_FD"}
    mpirun = subprocess.Popen(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(RANKS), *DLFS, "mount",
         "--mpi", tmp_path / "mnt-%n", "--store", store, "--cache-dir", tmp_path / "cache-%n",
         "--log-file", tmp_path / "log-%n", "--port-base", str(base),
         "--node-host", "127.0.0.1", "--workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not all(fstype_at(mp) == "fuse.dlfs" for mp in mounts[:-1]):
            assert mpirun.poll() is None, mpirun.communicate()
            assert time.monotonic() < deadline, "the other ranks did not mount"
            time.sleep(0.05)
        mpirun.send_signal(signal.SIGINT)
        mpirun.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while any(fstype_at(mp) or daemon_pids_for(mp) for mp in mounts):
            assert time.monotonic() < deadline, (
                "left mounted or running: " + ", ".join(
                    f"{mp.name} {fstype_at(mp)} {daemon_pids_for(mp)}" for mp in mounts))
            time.sleep(0.1)
        for name in names[:-1]:
            log = (tmp_path / f"log-{name}").read_text()
            # (or, were mpirun's SIGTERM to reach a rank still waiting for its mount,
            # `dlfs mount` would stop that daemon itself)
            assert "before committing this mount" in log or "got SIGTERM" in log, log
        left = [name for name, mp in zip(names, mounts, strict=True)
                if Path(launch_secret_file(name, os.path.realpath(mp))).exists()]
        assert left == [], "the secret files of a failed launch must go"
    finally:
        if mpirun.poll() is None:
            mpirun.kill()
            mpirun.communicate()

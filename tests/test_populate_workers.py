"""populate's worker processes (dlfs.store.packer): the same bytes whether one process
or several copy, every extent in exactly one task, and no worker outliving its
populate however that ends (done, failed, interrupted, killed, a worker killed).

Real processes and real signals; the bytes are checked against the source files
directly, not through the code under test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from conftest import DLFS, parent_pid, pid_alive, wait_dead
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import make_small_tree

from dlfs.errors import DlfsError, NotFoundError
from dlfs.store.directory import SourceEntry, build_directory
from dlfs.store.format import CHUNK_HEADER_SIZE, MAX_EXTENT_SIZE, chunk_path
from dlfs.store.packer import TASK_BYTES, TASK_EXTENTS, plan_tasks
from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Store
from dlfs.store.workers import worker_pool

SPARSE_FILES = 16
SPARSE_SIZE = 64 << 20  # 1 GiB of holes: seconds of copying, no disk for the source


# -- tasks ------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.one_of(st.integers(0, 5000), st.integers(0, 9 << 20)), max_size=80),
       chunk_size=st.sampled_from([4096, 65_536, 1 << 20, 64 << 20]),
       keep=st.integers(0, 2**32 - 1))
def test_tasks_cover_every_extent_once_inside_one_chunk(sizes, chunk_size, keep):
    entries = [SourceEntry(b"", 0o40755, 0, 0)] + [
        SourceEntry(b"f%03d" % i, 0o100644, size, 0) for i, size in enumerate(sizes)]
    d = build_directory(entries, chunk_size)
    chunk, offset = d.arrays["ext_chunk"], d.arrays["ext_offset"].astype(np.int64)
    length = d.arrays["ext_length"].astype(np.int64)
    chunks = int(chunk.max()) + 1 if len(chunk) else 0
    wanted = np.array([(keep >> (i % 32)) & 1 == 1 for i in range(chunks)], dtype=bool)
    for mask in (None, wanted):
        tasks = plan_tasks(d, mask)
        covered = np.concatenate([np.arange(a, b) for a, b in zip(tasks.first, tasks.end,
                                                                  strict=True)] + [[]])
        expected = np.arange(len(chunk)) if mask is None else np.flatnonzero(mask[chunk])
        assert covered.astype(np.int64).tolist() == expected.tolist()
        for a, b, c, n in zip(tasks.first, tasks.end, tasks.chunk, tasks.nbytes, strict=True):
            assert (chunk[a:b] == c).all()
            assert n == length[a:b].sum()  # back to back: one pwrite lands them all
            assert offset[b - 1] + length[b - 1] - offset[a] == n
            assert b - a <= TASK_EXTENTS and n <= TASK_BYTES + MAX_EXTENT_SIZE


# -- the pool: requests, replies and errors across the fork -----------------------------------
class Echo:
    """A job for the pool: replies with (its pid, the request) or raises what it is told."""

    def start(self) -> None:
        self.started = os.getpid()

    def run(self, request):
        kind, value = request
        if kind == "dlfs":
            raise NotFoundError(value)
        if kind == "os":
            raise OSError(28, "No space left on device", value)
        if kind == "bug":
            raise ZeroDivisionError(value)
        return self.started, value

    def stop(self) -> None:
        pass


def _all_replies(pool, requests):
    replies, sent = {}, 0
    while len(replies) < len(requests):
        while sent < len(requests) and pool.has_room():
            pool.submit(sent, requests[sent])
            sent += 1
        for tag, reply in pool.finished():
            assert tag not in replies
            replies[tag] = reply
    return [replies[i] for i in range(len(requests))]


@pytest.mark.parametrize("count", [1, 3])
def test_every_request_is_answered_once_with_its_own_reply(count):
    big = os.urandom(3 << 20)  # bigger than a pipe holds: comes back in pieces
    requests = [("echo", i) for i in range(50)] + [("echo", big)]
    with worker_pool(Echo(), count) as pool:
        replies = _all_replies(pool, requests)
    assert [value for _, value in replies] == [value for _, value in requests]
    pids = {pid for pid, _ in replies}
    if count == 1:
        assert pids == {os.getpid()}
    else:
        assert os.getpid() not in pids and 1 < len(pids) <= count
        assert not any(pid_alive(pid) for pid in pids), "reaped on leaving"


@pytest.mark.parametrize("count", [1, 3])
def test_a_failed_request_raises_its_error_in_the_caller(count):
    """Source errors (DlfsError) and store errors (OSError) as themselves; a bug in a
    worker as a RuntimeError carrying its traceback (inline: the bug itself)."""
    bug = (ZeroDivisionError, "1/0") if count == 1 else (RuntimeError, "ZeroDivisionError")
    for request, kind, text in ((("dlfs", "source not found: /x"), NotFoundError, "/x"),
                                (("os", "/store/c.chunk"), OSError, "/store/c.chunk"),
                                (("bug", "1/0"), *bug)):
        with pytest.raises(kind) as caught, worker_pool(Echo(), count) as pool:
            _all_replies(pool, [("echo", 1), request, ("echo", 2)])
        if kind is OSError:
            assert (caught.value.errno, caught.value.filename) == (28, text)
        else:
            assert text in str(caught.value)
        assert isinstance(caught.value, DlfsError) == (kind is NotFoundError)


# -- the same bytes, one process or several ------------------------------------------------
def _source_bytes_match(store: Path, name: str, source: Path) -> None:
    """Every file's bytes sit where the manifest says, and its checksums are theirs."""
    dataset = Store(store).open(name)
    d = dataset.directory
    files = d.file_rows().tolist()
    assert files
    for row in files:
        data = (source / os.fsdecode(d.path(row))).read_bytes()
        assert len(data) == d.size(row)
        for i, ext in enumerate(d.extents(row)):
            piece = data[i * d.extent_size:(i + 1) * d.extent_size]
            with open(chunk_path(dataset.path, d.ext_chunk_view[ext]), "rb") as f:
                f.seek(CHUNK_HEADER_SIZE + d.ext_offset_view[ext])
                assert f.read(d.ext_length_view[ext]) == piece, d.path(row)
            assert d.ext_checksum_view[ext] == xxhash.xxh3_64_intdigest(piece)


@pytest.mark.parametrize("chunk_size", [4096, 256 << 10])
def test_one_process_and_several_write_the_same_bytes(edge_tree, tmp_path, chunk_size):
    made = {}
    for jobs in (1, 3):
        store = tmp_path / f"store-{jobs}"
        options = PopulateOptions(chunk_size=chunk_size, jobs=jobs, progress=False,
                                  fsync=False)
        made[jobs] = populate(edge_tree.root, Store(store), "edge", options)
        _source_bytes_match(store, "edge", edge_tree.root)
    one, several = made[1], made[3]
    assert one.chunk_count == several.chunk_count > 1
    for key, array in one.directory.arrays.items():
        assert np.array_equal(several.directory.arrays[key], array), key
    for index in range(one.chunk_count):
        a = chunk_path(one.path, index).read_bytes()
        b = chunk_path(several.path, index).read_bytes()
        assert a[:24] + a[40:] == b[:24] + b[40:], index  # all but the dataset UUID


def test_more_files_than_a_task_in_one_directory(tmp_path):
    """A directory of thousands of files spans several tasks and read-ahead groups."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3 * TASK_EXTENTS + 7):
        (src / f"r{i:05d}").write_bytes(os.urandom(i % 300))
    populate(src, Store(tmp_path / "store"), "ds",
             PopulateOptions(chunk_size=1 << 20, jobs=2, progress=False, fsync=False))
    _source_bytes_match(tmp_path / "store", "ds", src)


# -- no worker outlives its populate --------------------------------------------------------
@pytest.fixture(scope="module")
def sparse_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sparse") / "src"
    root.mkdir()
    for i in range(SPARSE_FILES):
        with open(root / f"volume_{i:02d}.bin", "wb") as f:
            f.truncate(SPARSE_SIZE)
    make_small_tree(root / "small", files=10)
    return root


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_pid(int(entry)) == pid:
            found.append(int(entry))
    return found


def _start(source: Path, store: Path, jobs: int = 2) -> tuple[subprocess.Popen, list[int]]:
    """A CLI populate, once its workers are copying: (process, worker pids)."""
    proc = subprocess.Popen([*DLFS, "populate", str(source), "--store", str(store), "--name",
                             "big", "--chunk-size", "64M", "-j", str(jobs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        chunks = list(store.glob(".tmp-big.*/chunks/*.chunk")) if store.exists() else []
        workers = _children(proc.pid)
        if chunks and len(workers) == jobs:
            return proc, workers
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate()
            pytest.fail(f"populate exited {proc.returncode} or never started its workers: "
                        f"{out}{err}")
        time.sleep(0.002)


@pytest.fixture
def populates():
    """Teardown: kill whatever a failed test left running."""
    procs: list[tuple[subprocess.Popen, list[int]]] = []
    yield procs
    for proc, workers in procs:
        for pid in [proc.pid, *workers]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def test_a_killed_worker_fails_the_populate_in_one_line(sparse_source, tmp_path, populates):
    store = tmp_path / "store"
    proc, workers = _start(sparse_source, store)
    populates.append((proc, workers))
    os.kill(workers[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and f"worker process {workers[0]} died" in lines[0], stderr
    assert "SIGKILL" in lines[0] and "nothing was published" in lines[0]
    assert os.listdir(store) == []
    assert not any(pid_alive(pid) for pid in workers)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_populate_stops_its_workers_first(sparse_source, tmp_path, signum,
                                                        populates):
    store = tmp_path / "store"
    proc, workers = _start(sparse_source, store)
    populates.append((proc, workers))
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert len(stderr.splitlines()) == 1 and "interrupted" in stderr, stderr
    assert not any(pid_alive(pid) for pid in workers), "the workers were reaped before exit"
    assert os.listdir(store) == []


def test_ctrl_c_to_the_whole_process_group_is_one_interrupt(sparse_source, tmp_path,
                                                           populates):
    """A terminal's Ctrl-C reaches the workers too: they leave the stopping to the
    populate, which still says one line and leaves nothing."""
    store = tmp_path / "store"
    proc = subprocess.Popen([*DLFS, "populate", str(sparse_source), "--store", str(store),
                             "--name", "big", "-j", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    populates.append((proc, []))
    deadline = time.monotonic() + 60
    while not (len(_children(proc.pid)) == 2 and list(store.glob(".tmp-big.*/chunks/*"))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    workers = _children(proc.pid)
    populates[-1] = (proc, workers)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert len(stderr.splitlines()) == 1 and "interrupted" in stderr, stderr
    assert not any(pid_alive(pid) for pid in workers)
    assert os.listdir(store) == []


def test_workers_of_a_sigkilled_populate_stop_by_themselves(sparse_source, tmp_path,
                                                            populates):
    """Nothing can stop them for a populate killed with SIGKILL: the end of their task
    pipe does, once the task under way is done."""
    store = tmp_path / "store"
    proc, workers = _start(sparse_source, store)
    populates.append((proc, workers))
    proc.kill()
    proc.communicate(timeout=30)
    for pid in workers:
        assert wait_dead(pid, 30), f"worker {pid} still running 30 s after its populate died"

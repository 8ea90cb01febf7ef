"""Real FUSE mounts: what a training job sees through `dlfs mount` equals the source tree.

Every test goes through the kernel: a background `dlfs mount` of a store made by
the real `dlfs populate`, compared with the source tree it was made from.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import random
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from trees import (
    describe_tree,
    file_bytes,
    make_small_tree,
    regular_files,
    sha256_file,
)

from dlfs.store.format import CHUNK_HEADER_SIZE, chunk_path
from dlfs.store.store import Store
from dlfsd.core.values import BLKSIZE, DIR_BLKSIZE

pytestmark = pytest.mark.usefixtures("daemon_guard")


@pytest.fixture(scope="module")
def edge_mount(make_mounter, edge_store):
    """One mount of the edge dataset for the metadata and errno tests (they only read)."""
    mounter = make_mounter()
    try:
        yield mounter(edge_store)
    finally:
        mounter.cleanup()


def _diff(expected: dict, got: dict, limit: int = 10) -> list:
    keys = sorted(set(expected) | set(got))
    return [(k, expected.get(k), got.get(k)) for k in keys if expected.get(k) != got.get(k)][:limit]


# -- names and attributes ----------------------------------------------------------
def test_root_lists_the_dataset(edge_mount):
    assert os.listdir(edge_mount.path) == ["edge"]


def test_listing_equals_source(edge_mount, edge_nodes):
    got = set(describe_tree(edge_mount / "edge", hashes=False))
    missing = sorted(set(edge_nodes) - got)[:10]
    extra = sorted(got - set(edge_nodes))[:10]
    assert not missing and not extra, f"missing {missing}, extra {extra}"


@pytest.mark.parametrize("workers", ["1", "4"])
def test_a_directory_larger_than_one_listing_reply_lists_whole(mounted, store_with, tmp_path,
                                                               workers):
    """Directories advertise a 1 MiB block size, so glibc lists them with 1 MiB getdents
    calls and the kernel asks for READDIRPLUS replies that large; 9,000 entries (names of
    mixed lengths) still take two replies, which must join without a gap or a repeat."""
    src = tmp_path / "src"
    (src / "big").mkdir(parents=True)
    names = {f"s{i}" + "x" * (i % 11) for i in range(9000)}
    for name in names:
        (src / "big" / name).touch()
    m = mounted(store_with(src), "--workers", workers)
    big = m / "ds/big"
    assert os.stat(big).st_blksize == DIR_BLKSIZE
    assert os.stat(big / "s0").st_blksize == BLKSIZE
    listed = [e.name for e in os.scandir(big)]
    assert len(listed) == len(names) and set(listed) == names
    assert [e.name for e in os.scandir(big)] == listed  # stable order across listings


def test_a_dataset_copied_within_the_store_mounts_under_its_directory_name(
        mounted, store_with, tmp_path, dlfs_cli):
    """Before, the mount named each dataset by the name in its manifest: a copy made with
    `cp -a store/ds store/ds-v2` appeared as a second `ds`, and the copy was out of
    reach, while `dlfs ls` and `--dataset` went by the directory names."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"sample a")
    store = store_with(src)
    shutil.copytree(store / "ds", store / "ds-v2", symlinks=True)
    m = mounted(store)
    assert sorted(os.listdir(m.path)) == ["ds", "ds-v2"]
    assert (m / "ds-v2/a.bin").read_bytes() == b"sample a"
    info = dlfs_cli("info", "--store", store, "ds-v2")
    assert info.stdout.splitlines()[0].split() == ["name:", "ds-v2"], info.stdout
    only = mounted(store, "--dataset", "ds-v2")
    assert os.listdir(only.path) == ["ds-v2"]


def test_debug_logs_every_request_the_workers_serve(mounted, store_with, tmp_path):
    """`--debug` ("log every FUSE request") logged none with the worker processes:
    only the single-process mode (since removed), served by pyfuse3, logged them."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "sample.bin").write_bytes(b"x" * 5000)
    m = mounted(store_with(src), "--debug", "--workers", "2")
    assert (m / "ds/d/sample.bin").read_bytes() == b"x" * 5000
    with pytest.raises(FileNotFoundError):
        os.stat(m / "ds/d/missing")
    log = m.log_text()
    assert "lookup inode" in log and "name b'sample.bin'" in log, log
    assert re.search(r"request \d+ read inode \d+ from pid \d+ fh 0 offset 0", log), log
    assert re.search(r"request \d+ -> 5000 bytes", log), log
    assert "name b'missing'" in log and "-> ENOENT" in log, log


def test_a_listed_directory_is_listed_again_by_the_kernel_alone(mounted, store_with,
                                                                tmp_path):
    """Listings never change, so the kernel keeps them (the daemon lets it open
    directories itself, FUSE no_opendir, which caches listings): with every daemon
    process stopped, a second listing of a directory and a stat of its entries still
    answer at once; only a directory never listed has to wait for the daemon."""
    src = tmp_path / "src"
    for d in ("seen", "unseen"):
        (src / d).mkdir(parents=True)
        for i in range(50):
            (src / d / f"f{i}").write_bytes(b"x" * i)
    m = mounted(store_with(src))
    seen, unseen = m / "ds/seen", m / "ds/unseen"
    first = sorted(os.listdir(seen))
    assert first == sorted(f"f{i}" for i in range(50))
    os.stat(unseen)  # known to the kernel, but its listing was never asked for
    lister = ("import os, sys; p = sys.argv[1]; "
              "print(sorted((n, os.lstat(os.path.join(p, n)).st_size) for n in os.listdir(p)))")
    for pid in m.pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        again = subprocess.run([sys.executable, "-c", lister, seen], capture_output=True,
                               text=True, timeout=10)
        waiting = subprocess.Popen([sys.executable, "-c", lister, unseen],
                                   stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=1.0)  # the daemon must answer this one
    finally:
        for pid in m.pids:
            os.kill(pid, signal.SIGCONT)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == str(sorted((f"f{i}", i) for i in range(50)))
    out, _ = waiting.communicate(timeout=30)
    assert out.strip() == str(sorted((f"f{i}", i) for i in range(50)))


def test_fifo_is_not_in_the_mount(edge_mount, edge_tree):
    assert edge_tree.specials, "the edge tree must contain a fifo"
    for rel in edge_tree.specials:
        assert not os.path.lexists(edge_mount / b"edge/" + rel)
        parent = os.path.dirname(rel)
        siblings = set(os.listdir(edge_mount / b"edge/" + parent))
        assert os.path.basename(rel) not in siblings
        assert siblings, "the regular file next to the fifo must be packed"


def test_lstat_equals_source(edge_mount, edge_nodes):
    got = describe_tree(edge_mount / "edge", hashes=False)

    def attrs(nodes):
        return {rel: (stat.filemode(n.mode), n.mode, n.size, n.mtime_ns)
                for rel, n in nodes.items()}

    assert _diff(attrs(edge_nodes), attrs(got)) == []


def test_mtimes_keep_nanoseconds(edge_mount, edge_nodes):
    odd = [rel for rel, n in edge_nodes.items() if n.mtime_ns % 1000]
    assert len(odd) > len(edge_nodes) // 2, "the edge tree must use sub-microsecond mtimes"
    for rel in odd[:200]:
        assert os.lstat(edge_mount / b"edge/" + rel).st_mtime_ns == edge_nodes[rel].mtime_ns


def test_readlink_equals_source(edge_mount, edge_nodes):
    links = {rel: n.link for rel, n in edge_nodes.items() if n.kind == stat.S_IFLNK}
    assert len(links) >= 5, "the edge tree must contain symlinks"
    got = {rel: os.readlink(edge_mount / b"edge/" + rel) for rel in links}
    assert got == links


def test_symlinks_resolve_inside_the_mount(edge_mount, edge_nodes):
    rel = edge_mount / b"edge/links/rel"
    assert sha256_file(rel) == edge_nodes[b"small/g00/h0/f00000.bin"].sha256
    assert os.path.isdir(edge_mount / b"edge/links/rel_dir/d01")


def test_statfs_covers_dataset_bytes(edge_mount, edge_nodes):
    st = os.statvfs(edge_mount.path)
    assert st.f_blocks * st.f_frsize >= file_bytes(edge_nodes) > 0


# -- file contents -----------------------------------------------------------------
@pytest.mark.parametrize("workers", ["1", "4"])
def test_every_file_reads_back_identical(mounted, edge_store, edge_nodes, workers):
    m = mounted(edge_store, "--workers", workers)  # fresh: extents are checked on first read
    root = m / b"edge"
    wrong = [rel for rel in regular_files(edge_nodes)
             if sha256_file(os.path.join(root, rel)) != edge_nodes[rel].sha256]
    assert wrong == []


@pytest.mark.parametrize("release", ["4.18.0-553.el8_10.x86_64", "3.10.0-1160.el7.x86_64"])
def test_on_kernels_without_no_open_opens_are_answered(mounted, edge_store, edge_nodes,
                                                       monkeypatch, release):
    """Kernels before 4.14 (no_open) and 5.1 (no_opendir) hand our ENOSYS to the
    application; there the workers answer OPEN and OPENDIR instead. This kernel takes
    either answer, so a stand-in release string exercises that path end to end."""
    monkeypatch.setenv("DLFSD_KERNEL_RELEASE", release)
    m = mounted(edge_store, "--workers", "2")
    root = m / b"edge"
    assert set(describe_tree(root, hashes=False)) == set(edge_nodes)
    wrong = [rel for rel in regular_files(edge_nodes)
             if sha256_file(os.path.join(root, rel)) != edge_nodes[rel].sha256]
    assert wrong == []
    snapshot = json.loads((m.path / ".dlfs" / "stats.json").read_bytes())
    answered = "OPENDIR" if release.startswith("4.") else "OPEN and OPENDIR"
    # Opens the workers answer are counted, and the snapshot must say so.
    assert snapshot["opens_counted"] == (answered != "OPENDIR")
    if snapshot["opens_counted"]:
        assert snapshot["datasets"]["edge"]["opens"] > 0
    assert f"the workers answer {answered} " in m.log.read_text()


def test_reads_across_extent_and_chunk_boundaries(mounted, edge_store, edge_tree):
    m = mounted(edge_store)
    cs = edge_tree.chunk_size
    files = sorted(set(edge_tree.big_files + edge_tree.boundary_files))
    assert files
    for rel in files:
        src = os.open(edge_tree.path(rel), os.O_RDONLY)
        dst = os.open(m / b"edge/" + rel, os.O_RDONLY)
        try:
            size = os.fstat(src).st_size
            offsets = {0, cs - 1, cs, cs + 1, 2 * cs - 3, size - 1, size, size + 10}
            for off in sorted(o for o in offsets if o >= 0):
                for length in (1, 7, cs + 2, 3 * cs):
                    assert os.pread(dst, length, off) == os.pread(src, length, off), \
                        (rel, off, length)
        finally:
            os.close(src)
            os.close(dst)


def _parallel_reader(barrier, results, mount_root: bytes, source_root: bytes,
                     jobs: list[tuple[bytes, str]], ranges: list[tuple[bytes, int, int]],
                     ident: int) -> None:
    try:
        barrier.wait(timeout=60)
        wrong, done = [], 0
        for rel, digest in jobs:
            if sha256_file(os.path.join(mount_root, rel)) != digest:
                wrong.append(rel)
            done += 1
        for rel, off, length in ranges:
            with open(os.path.join(mount_root, rel), "rb") as a, \
                    open(os.path.join(source_root, rel), "rb") as b:
                if os.pread(a.fileno(), length, off) != os.pread(b.fileno(), length, off):
                    wrong.append((rel, off, length))
            done += 1
        results.put((ident, wrong, done, None))
    except BaseException as err:  # report, never hang the parent
        results.put((ident, None, 0, repr(err)))


@pytest.mark.parametrize("workers", ["1", "4"])
def test_eight_processes_read_at_once(mounted, edge_store, edge_tree, edge_nodes, workers):
    m = mounted(edge_store, "--workers", workers)
    files = regular_files(edge_nodes)
    big = [rel for rel in files if edge_nodes[rel].size > edge_tree.chunk_size]
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(8)
    results = ctx.Queue()
    procs, planned = [], {}
    try:
        for ident in range(8):
            rng = random.Random(ident)
            chosen = rng.sample(files, 300) + big
            rng.shuffle(chosen)
            ranges = [(rel, rng.randrange(edge_nodes[rel].size), rng.randrange(1, 600_000))
                      for rel in big for _ in range(10)]
            jobs = [(rel, edge_nodes[rel].sha256) for rel in chosen]
            planned[ident] = len(jobs) + len(ranges)
            p = ctx.Process(target=_parallel_reader, args=(
                barrier, results, m / b"edge", edge_tree.broot, jobs, ranges, ident))
            p.start()
            procs.append(p)
        outcome = [results.get(timeout=120) for _ in procs]
    finally:  # never leave readers behind, whatever failed
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert [err for *_, err in outcome if err] == []
    assert {ident: wrong for ident, wrong, _, _ in outcome if wrong} == {}
    assert {ident: done for ident, _, done, _ in outcome} == planned  # every check ran


# -- errors --------------------------------------------------------------------------
WRITE_ATTEMPTS = {
    "open_wronly": lambda d: os.open(d / "empty.txt", os.O_WRONLY),
    "open_rdwr": lambda d: os.open(d / "big/page.bin", os.O_RDWR),
    "open_append": lambda d: os.open(d / "big/page.bin", os.O_WRONLY | os.O_APPEND),
    "open_trunc": lambda d: os.open(d / "big/page.bin", os.O_RDONLY | os.O_TRUNC),
    "create": lambda d: os.open(d / "new.txt", os.O_CREAT | os.O_WRONLY, 0o644),
    "create_excl": lambda d: os.open(d / "new.txt", os.O_CREAT | os.O_EXCL | os.O_RDWR),
    "mkdir": lambda d: os.mkdir(d / "newdir"),
    "mkdir_top_level": lambda d: os.mkdir(d.parent / "newdataset"),
    "rmdir": lambda d: os.rmdir(d / "empty_dir"),
    "unlink": lambda d: os.unlink(d / "empty.txt"),
    "unlink_symlink": lambda d: os.unlink(d / "links/dangling"),
    "rename": lambda d: os.rename(d / "empty.txt", d / "renamed.txt"),
    "rename_dir": lambda d: os.rename(d / "empty_dir", d / "moved_dir"),
    "chmod": lambda d: os.chmod(d / "empty.txt", 0o777),
    "chown": lambda d: os.chown(d / "empty.txt", 1, 1),
    "utime": lambda d: os.utime(d / "empty.txt", ns=(0, 0)),
    "setxattr": lambda d: os.setxattr(d / "empty.txt", "user.dlfs", b"v"),
    "removexattr": lambda d: os.removexattr(d / "empty.txt", "user.dlfs"),
    "truncate": lambda d: os.truncate(d / "big/page.bin", 0),
    "symlink": lambda d: os.symlink("target", d / "newlink"),
    "hardlink": lambda d: os.link(d / "empty.txt", d / "hardlink"),
    "mkfifo": lambda d: os.mkfifo(d / "newfifo"),
}


@pytest.mark.parametrize("attempt", sorted(WRITE_ATTEMPTS))
def test_modification_gives_erofs(edge_mount, attempt):
    try:
        result = WRITE_ATTEMPTS[attempt](edge_mount / "edge")
    except OSError as err:
        assert err.errno == errno.EROFS, err
    else:
        if isinstance(result, int):
            os.close(result)
        pytest.fail(f"{attempt} succeeded on a read-only mount")


def test_write_attempts_change_nothing(edge_mount, edge_nodes):
    before = describe_tree(edge_mount / "edge", hashes=False)
    for attempt in WRITE_ATTEMPTS.values():
        try:
            result = attempt(edge_mount / "edge")
        except OSError:
            continue
        if isinstance(result, int):
            os.close(result)
    assert describe_tree(edge_mount / "edge", hashes=False) == before
    assert sha256_file(edge_mount / "edge/big/page.bin") == edge_nodes[b"big/page.bin"].sha256


@pytest.mark.parametrize("rel", [
    b"no_such_dataset",
    b"edge/no_such_file",
    b"edge/small/g00/h0/nope.bin",
    b"edge/deep/d01/d02/d03/missing/more",
    b"edge/names/bad\xff\xfenam",  # a prefix of a real non-UTF-8 name
    b"edge/EMPTY.TXT",  # names are case-sensitive
])
def test_missing_name_gives_enoent(edge_mount, rel):
    path = edge_mount / rel
    with pytest.raises(FileNotFoundError):
        os.lstat(path)
    with pytest.raises(FileNotFoundError):
        os.open(path, os.O_RDONLY)


@pytest.mark.parametrize("call", ["lstat", "open", "listdir"])
@pytest.mark.parametrize("rel", [b"edge/empty.txt/child", b"edge/big/one_mib.bin/x/y"])
def test_path_through_a_file_gives_enotdir(edge_mount, rel, call):
    path = edge_mount / rel
    op = {"lstat": os.lstat, "open": lambda p: os.open(p, os.O_RDONLY),
          "listdir": os.listdir}[call]
    with pytest.raises(NotADirectoryError):
        op(path)


def test_listdir_of_a_file_gives_enotdir(edge_mount):
    with pytest.raises(NotADirectoryError):
        os.listdir(edge_mount / "edge/empty.txt")


def test_open_directory_for_reading_bytes_gives_eisdir(edge_mount):
    fd = os.open(edge_mount / "edge/small", os.O_RDONLY)
    try:
        with pytest.raises(IsADirectoryError):
            os.read(fd, 10)
    finally:
        os.close(fd)


# -- several datasets ----------------------------------------------------------------
def test_more_chunk_files_than_the_open_file_limit_still_read(mounted, store_with, tmp_path):
    """Workers keep chunk files open; one that runs out of descriptors closes its own and
    goes on (before: EIO for every chunk not yet open)."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(7)
    for i in range(240):  # ~30 KiB each in 64 KiB chunks: >100 chunk files
        (src / f"f{i:03d}").write_bytes(rng.randbytes(rng.randint(20_000, 40_000)))
    store = store_with(src, "ds", "64K", tmp_path / "store")
    chunks = len(os.listdir(store / "ds" / "chunks"))
    assert chunks > 100
    m = mounted(store, "--workers", "2")
    for pid in m.pids:  # room for 20 more descriptors than each process has open now
        limit = len(os.listdir(f"/proc/{pid}/fd")) + 20
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))
    names = sorted(os.listdir(src))
    rng.shuffle(names)
    for _ in range(2):  # twice, so every worker meets the limit
        for name in names:
            assert _read(m / "ds" / name) == (src / name).read_bytes(), name
    assert "out of file descriptors" in m.log_text()
    assert "reads return EIO" not in m.log_text()


def test_open_file_limit_is_raised_and_a_shortfall_is_said_once_at_mount():
    """raise_fd_limit in a process started with a soft limit of 64 (hard 2048): raised to
    at least the hard limit; if the chunk files need more than it could get, one warning."""
    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr)\n"
            "from dlfsd.assemble import raise_fd_limit\n"
            "print(raise_fd_limit(10), raise_fd_limit(100_000))")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 2048)))
    assert result.returncode == 0, result.stderr
    small, large = map(int, result.stdout.split())
    assert small >= 2048 and large >= small
    warnings = [line for line in result.stderr.splitlines() if "open-file limit" in line]
    assert len(warnings) == (1 if large < 100_000 + 1024 else 0), result.stderr
    if warnings:
        assert f"open-file limit {large} is below the 101024" in warnings[0]


@pytest.fixture
def two_datasets(tmp_path, store_with):
    store = tmp_path / "store"
    roots = {}
    for i, name in enumerate(("alpha", "beta")):
        roots[name] = tmp_path / f"src-{name}"
        make_small_tree(roots[name], files=30, seed=i, prefix=name)
        store_with(roots[name], name, "256K", store)
    return store, roots


@pytest.mark.parametrize("selected", [(), ("beta",), ("alpha",), ("alpha", "beta")])
def test_dataset_selection_shows_only_those(mounted, two_datasets, selected):
    store, roots = two_datasets
    args = [a for name in selected for a in ("--dataset", name)]
    m = mounted(store, *args)
    expected = sorted(selected or roots)
    assert sorted(os.listdir(m.path)) == expected
    for name in expected:
        assert describe_tree(m / name) == describe_tree(roots[name])
    for name in set(roots) - set(expected):
        assert not os.path.exists(m / name)


# -- corruption ----------------------------------------------------------------------
def flip_byte(store: Path, name: str, rel: bytes, source: Path) -> None:
    """Flip the middle byte of file `rel` inside its chunk file (found via the extent table)."""
    dataset = Store(store).open(name)
    d = dataset.directory
    row = d.resolve(rel)
    assert row >= 0, rel
    ext = d.first_extent(row)
    length = d.ext_length_view[ext]
    chunk = chunk_path(dataset.path, d.ext_chunk_view[ext])
    offset = CHUNK_HEADER_SIZE + d.ext_offset_view[ext] + length // 2
    with open(os.path.join(os.fsencode(source), rel), "rb") as f:
        f.seek(length // 2)
        original = f.read(1)
    with open(chunk, "r+b") as f:
        f.seek(offset)
        assert f.read(1) == original, "extent table does not point at the file's bytes"
        f.seek(offset)
        f.write(bytes([original[0] ^ 0xFF]))


TARGET = b"d1/f021.bin"
BAD_TARGET = b"d1/bad\xff\xfename"  # not valid UTF-8


@pytest.fixture
def corrupt_store(tmp_path, store_with):
    """(store, source) of a small dataset; tests flip a byte of TARGET or BAD_TARGET."""
    source = tmp_path / "src"
    make_small_tree(source, files=40, seed=7)
    with open(os.path.join(os.fsencode(source), BAD_TARGET), "wb") as f:
        f.write(random.Random(3).randbytes(3000))
    return store_with(source, "ds"), source


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_corrupt_file_gives_eio(mounted, corrupt_store):
    store, source = corrupt_store
    flip_byte(store, "ds", TARGET, source)
    m = mounted(store)
    for _ in range(2):  # and it stays an error: wrong bytes are never cached
        with pytest.raises(OSError) as info:
            _read(m / b"ds/" + TARGET)
        assert info.value.errno == errno.EIO


def test_other_files_read_fine_next_to_a_corrupt_one(mounted, corrupt_store):
    store, source = corrupt_store
    flip_byte(store, "ds", TARGET, source)
    m = mounted(store)
    with pytest.raises(OSError):
        _read(m / b"ds/" + TARGET)
    expected = describe_tree(source)
    others = [rel for rel in regular_files(expected) if rel != TARGET]
    wrong = [rel for rel in others
             if sha256_file(os.path.join(m / b"ds", rel)) != expected[rel].sha256]
    assert wrong == []


@pytest.mark.parametrize("workers", [
    "1",
    "4",
])
def test_daemon_logs_corrupt_file_once(mounted, corrupt_store, workers):
    store, source = corrupt_store
    flip_byte(store, "ds", TARGET, source)
    m = mounted(store, "--workers", workers)
    for _ in range(20):
        with pytest.raises(OSError):
            _read(m / b"ds/" + TARGET)
    lines = [line for line in m.log_text().splitlines() if TARGET.decode() in line]
    assert len(lines) == 1, m.log_text()


def test_daemon_logs_corrupt_non_utf8_name_once(mounted, corrupt_store):
    store, source = corrupt_store
    flip_byte(store, "ds", BAD_TARGET, source)
    m = mounted(store, "--workers", "1")  # one process: see the per-worker bug above
    for _ in range(2):
        with pytest.raises(OSError):
            _read(m / b"ds/" + BAD_TARGET)
    log = m.log_text()
    assert "Logging error" not in log and "Traceback" not in log, log
    lines = [line for line in log.splitlines() if "d1/bad" in line and "name" in line]
    assert len(lines) == 1, log


def test_verify_exits_3_and_names_the_corrupt_file(dlfs_cli, corrupt_store):
    store, source = corrupt_store
    assert dlfs_cli("verify", "--store", store, "ds").returncode == 0
    flip_byte(store, "ds", TARGET, source)
    result = dlfs_cli("verify", "--store", store, "ds")
    assert result.returncode == 3, result
    named = [line for line in result.stdout.splitlines() if TARGET.decode() in line]
    assert len(named) == 1, result.stdout
    assert "d1/f020.bin" not in result.stdout and "d1/f022.bin" not in result.stdout
    assert result.stderr.startswith("dlfs: error:") and "Traceback" not in result.stderr


def test_verify_names_corrupt_non_utf8_file_on_utf8_stdout(dlfs_cli, corrupt_store):
    store, source = corrupt_store
    flip_byte(store, "ds", BAD_TARGET, source)
    # A UTF-8 locale such as en_US.UTF-8 gives Python a strict UTF-8 stdout (C.UTF-8 does not).
    result = dlfs_cli("verify", "--store", store, "ds", env={"PYTHONIOENCODING": "utf-8"})
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 3
    assert len([line for line in result.stdout.splitlines() if "d1/bad" in line]) == 1

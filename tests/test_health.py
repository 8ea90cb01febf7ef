"""Pool health where an operator looks: stalled reads, peers down, staging trouble.

The pieces first, as the daemon uses them (real shared memory across a real
fork, a real Stager copying real chunks), then real daemons: a peer whose
processes are stopped (SIGSTOP) in a two-node loopback pool, a store slowed
below the stall threshold, a pool of one whose store holds a bad chunk and
whose cache limit is too small, and a healthy pool that shows no problem.
Waits are bounded polls for a condition, never timing asserts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import pytest
import trio
from conftest import chunked_dataset, daemon_pids_for, describe_result, populate_store, until
from test_pool import (  # the pool helpers, reused
    Cluster,
    expected_shares,
    read_and_compare,
    source_files,
    wait_staged,
)

from dlfs.demo.sampledata import generate_large_files, generate_tree
from dlfs.obs.healthview import peer_server_problems, problem_lines
from dlfs.obs.statusview import plain_lines
from dlfs.store.format import CHUNK_HEADER_SIZE
from dlfs.store.store import Store
from dlfsd.base.slots import ProcessSlot
from dlfsd.obs.peermarks import PeerMarks
from dlfsd.obs.sharedjson import SharedJson
from dlfsd.obs.stalls import (
    WAIT_PEER,
    WAIT_STORE,
    RequestSlots,
    StallWatch,
)
from dlfsd.pool.chunkcache import ChunkCache
from dlfsd.pool.stager import DemandChannel, Stager

SECOND = 1_000_000_000


# -- helpers ---------------------------------------------------------------------------
@contextmanager
def forked(child):
    """Run `child()` in a forked process that then waits; yield once it has run; the
    child is released and reaped on leaving, whatever happens."""
    ran_r, ran_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(ran_r)
            os.close(go_w)
            child()
            os.write(ran_w, b"x")
            os.read(go_r, 1)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(ran_w)
    os.close(go_r)
    try:
        assert os.read(ran_r, 1) == b"x", "the child process failed"
        yield
    finally:
        os.close(go_w)  # the child's read returns: it exits
        os.close(ran_r)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def wait_for(what: str, condition, timeout: float = 60.0, every: float = 0.2):
    """Poll `condition()` until it returns something true (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def health_of(dlfs_cli, mount) -> dict:
    result = dlfs_cli("status", mount.path, "--json")
    assert result.returncode == 0, describe_result(result)
    return json.loads(result.stdout).get("health", {})


def plain_status(dlfs_cli, mount) -> list[str]:
    result = dlfs_cli("status", mount.path)  # not a terminal: plain lines
    assert result.returncode == 0, describe_result(result)
    return result.stdout.splitlines()


def metrics_of(mount) -> dict[str, dict[tuple, float]]:
    """`.dlfs/metrics` parsed: {sample name: {sorted label items: value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (Path(mount.path) / ".dlfs" / "metrics").read_text()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


@contextmanager
def stopped(pids: list[int]):
    """SIGSTOP these processes; SIGCONT them on leaving, whatever happens."""
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


# -- the pieces --------------------------------------------------------------------------
def test_a_read_in_a_forked_worker_is_seen_by_the_main_process_and_logged_once(caplog):
    slot = ProcessSlot(3)
    slots = RequestSlots.for_processes(slot)
    watch = StallWatch(slots, 5.0, lambda ds, row: f"ds{ds}/file{row}",
                       lambda node: f"n{node + 1}")
    now = time.perf_counter_ns()

    def worker() -> None:  # begun 30 s ago, now waiting for the peer of index 1
        slots.begin(2, 77, now - 30 * SECOND)
        slots.waiting(WAIT_PEER, 1)

    caplog.set_level(logging.INFO, logger="dlfsd.obs.stalls")
    try:
        with forked(worker):
            for _ in range(3):  # three scans, one stall: logged and counted once
                stalled, oldest = watch.scan(now)
                assert [(s.path, s.waiting) for s in stalled] == [("ds2/file77", "peer n2")]
                assert oldest >= 30
            assert stalled[0].pid != os.getpid()  # the worker's own pid, from its slot
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "ds2/file77" in warnings[0] \
                and "peer n2" in warnings[0], warnings
            assert watch.stalls_total() == 1 and watch.total["peer"] == 1
    finally:
        slots.close()


def test_the_main_process_sees_nothing_stalled_for_a_read_under_the_threshold_or_done(caplog):
    slot = ProcessSlot(2)
    slots = RequestSlots.for_processes(slot)
    watch = StallWatch(slots, 10.0, lambda ds, row: f"ds{ds}/file{row}")
    now = time.perf_counter_ns()
    caplog.set_level(logging.INFO, logger="dlfsd.obs.stalls")
    try:
        slots.begin(0, 1, now - 2 * SECOND)  # young: outstanding, not stalled
        assert watch.scan(now) == ([], 2.0)
        slots.end()
        slots.begin(0, 3, now - 20 * SECOND)
        slots.waiting(WAIT_STORE)
        assert [s.waiting for s in watch.scan(now)[0]] == ["store"]
        slots.end()  # done: the next scan says so, in the log
        assert watch.scan(now) == ([], 0.0)
        assert any("is done" in r.getMessage() for r in caplog.records)
        assert watch.total["store"] == 1
    finally:
        slots.close()


def test_a_read_whose_worker_died_is_forgotten_not_reported_stalled_for_ever():
    slot = ProcessSlot(2)
    slots = RequestSlots.for_processes(slot)
    watch = StallWatch(slots, 1.0, lambda ds, row: f"ds{ds}/file{row}")
    now = time.perf_counter_ns()
    try:
        pid = os.fork()
        if pid == 0:  # dies in the middle of its read (the OOM killer, a bug)
            slots.begin(0, 5, now - 30 * SECOND)
            os._exit(0)
        os.waitpid(pid, 0)
        assert slots.outstanding() != []
        assert watch.scan(now) == ([], 0.0)
        assert slots.outstanding() == [] and watch.stalls_total() == 0
    finally:
        slots.close()


def test_peer_marks_made_in_a_worker_are_seen_by_the_main_process():
    slot = ProcessSlot(3)
    marks = PeerMarks(slot, 4)
    until_ = time.monotonic() + 30

    def worker() -> None:
        marks.down(2, until_, "unavailable (timed out after 5 s)")
        marks.bad_copy(1, 0, 17, until_)

    try:
        with forked(worker):
            by_node = {p.node: p for p in marks.report()}
        assert set(by_node) == {1, 2}, "only marked peers are reported"
        assert by_node[2].down_processes == 1 and by_node[2].down_marks == 1
        assert by_node[2].down_why == "unavailable (timed out after 5 s)"
        assert 0 < by_node[2].down_seconds_left <= 30
        assert by_node[1].bad_processes == 1 and by_node[1].bad_chunk == 17
        # Expired marks are history: still counted, no longer down.
        later = {p.node: p for p in marks.report(until_ + 1)}
        assert later[2].down_processes == 0 and later[2].down_marks == 1
    finally:
        marks.close()


def test_a_published_health_report_is_read_in_a_forked_process_and_too_large_falls_back():
    shared = SharedJson(capacity=4096)
    got = {}
    try:
        assert shared.read() == {}
        assert shared.publish({"stalled_reads": 1, "stalled": [{"path": "a"}]})

        def worker() -> None:
            got.update(shared.read())
            assert got == {"stalled_reads": 1, "stalled": [{"path": "a"}]}

        with forked(worker):
            pass
        big = {"stalled": ["x" * 100] * 100, "stalled_reads": 100}
        assert shared.publish(big, {"stalled_reads": 100})
        assert shared.read() == {"stalled_reads": 100}
    finally:
        shared.close()


def test_problem_lines_one_per_problem_and_none_when_healthy():
    assert problem_lines(None) == [] and problem_lines({}) == []
    healthy = {"stall_seconds": 10.0, "stalls_total": 0, "stalled_reads": 0, "stalled": [],
               "peers_down": 0, "peers": [],
               "staging": {"datasets": {"ds": {"over_limit_chunks": 0, "over_limit_bytes": 0,
                                               "demanded_chunks": 2,
                                               "demanded_oldest_seconds": 1.0,
                                               "failing_chunks": 0, "failing_example": None}},
                           "copy_errors": 0, "cache_limit": 0, "paused": None}}
    assert problem_lines(healthy) == []  # a fresh demand is staging at work
    sick = json.loads(json.dumps(healthy))
    sick["stalled"] = [{"path": "ds/a.jpg", "waiting": "peer n2", "seconds": 42.0, "pid": 9}]
    sick["stalled_reads"] = 1
    sick["peers_down"] = 1
    sick["peers"] = [{"name": "n2", "down_processes": 2, "down_seconds_left": 7.0,
                      "down_why": "unavailable (timed out)", "down_marks": 3,
                      "bad_copy_processes": 1, "bad_copy_seconds_left": 50.0,
                      "bad_copy_marks": 1, "bad_copy_dataset": "ds", "bad_copy_chunk": 17}]
    sick["staging"]["datasets"]["ds"].update(
        over_limit_chunks=4, over_limit_bytes=4 << 20, demanded_oldest_seconds=30.0,
        failing_chunks=1, failing_example={"chunk": 5, "error": "checksum mismatch",
                                           "retry_seconds": 9.0})
    sick["staging"]["paused"] = {"seconds_left": 20.0, "error": "No space left on device"}
    lines = problem_lines(sick)
    assert all(line.startswith("problem: ") for line in lines)
    expected = ["ds/a.jpg stalled for 42 s, waiting for peer n2", "peer n2 is down for 2",
                "peer n2 sent a bad copy of chunk 17 of ds", "staging paused",
                "4 owned chunks (4.0 MiB) not staged: over --cache-limit",
                "2 chunks readers asked for", "cannot stage 1 chunk, e.g. chunk 5"]
    assert len(lines) == len(expected), lines
    for words in expected:
        assert sum(words in line for line in lines) == 1, (words, lines)


def test_the_rich_view_renders_the_problems(capsys):
    from rich.console import Console

    from dlfs.obs.statusview import rich_view

    status = {"mountpoint": "/mnt/x", "store": "/s", "pid": 1, "log": "/l", "pooled": False,
              "datasets": [], "health": {
                  "stall_seconds": 10.0, "stalls_total": 1, "stalls_by_source": {"store": 1},
                  "stalled_reads": 1, "stalled": [{"path": "ds/f", "waiting": "store",
                                                   "seconds": 12.0, "pid": 7}]}}
    console = Console(record=True, width=200)
    console.print(rich_view(status))
    text = console.export_text()
    assert "problem: read of ds/f stalled for 12 s, waiting for store" in text
    assert "stalls: 1 read outstanding over 10 s since mount" in text


@pytest.mark.parametrize(("value", "ok"), [("0", True), ("2.5", True), ("-1", False),
                                           ("nan", False), ("x", False)])
def test_stall_seconds_flag(value, ok, dlfs_cli, tmp_path):
    from dlfs.cli.main import build_parser

    args = ["mount", str(tmp_path), "--store", str(tmp_path), "--stall-seconds", value]
    if ok:
        assert build_parser().parse_args(args).stall_seconds == float(value)
    else:
        result = dlfs_cli(*args)
        assert result.returncode == 2 and "--stall-seconds" in result.stderr, \
            describe_result(result)


# -- the stager's own account ------------------------------------------------------------
@pytest.fixture
def dataset(tmp_path):
    ds = chunked_dataset(tmp_path, files=6, seed=11)
    assert ds.chunk_count >= 4
    return ds


def make_stager(dataset, tmp_path, **kwargs) -> Stager:
    cache = ChunkCache(tmp_path / "cache", dataset)
    cache.scan()
    return Stager([dataset], [cache], [np.ones(dataset.chunk_count, dtype=bool)],
                  DemandChannel(), **kwargs)


def close_stager(stager: Stager) -> None:
    stager.caches[0].close()
    stager.demand.close()


async def test_the_stager_reports_chunks_over_its_limit_and_a_chunk_it_cannot_copy(
        dataset, tmp_path):
    with open(dataset.chunk_path(0), "r+b") as f:  # a bad store copy of chunk 0
        f.seek(CHUNK_HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(CHUNK_HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    lengths = dataset.chunk_lengths
    limit = int(lengths[1] + lengths[2])  # room for chunks 1 and 2
    stager = make_stager(dataset, tmp_path, jobs=1, cache_limit=limit)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stager.run)
            assert await until(lambda: stager.finished is not None, 60), "staging never idled"
            health = stager.health()
            nursery.cancel_scope.cancel()
    finally:
        close_stager(stager)
    rest = list(range(3, dataset.chunk_count))
    assert health.over_limit_chunks == [len(rest)]
    assert health.over_limit_bytes == [int(sum(lengths[c] for c in rest))]
    assert health.failing_chunks == [1] and health.copy_errors == 1
    chunk, error, retry = health.failing_example[0]
    assert chunk == 0 and "checksum mismatch" in error and retry > 0
    assert health.demanded_chunks == [0] and health.paused is None


async def test_the_stager_reports_demanded_chunks_until_it_has_staged_them(
        dataset, tmp_path, monkeypatch):
    from dlfsd.pool import stager as stager_module

    monkeypatch.setattr(stager_module, "READ_BLOCK", 16 << 10)
    # ~1 s a chunk: the two demanded chunks stay demanded for 1-3 s, which the 5 ms
    # polls below see hundreds of times (64 KiB/s, 4 s a chunk, made the test 12 s)
    stager = make_stager(dataset, tmp_path, jobs=1, store_rate=256 << 10)
    last = dataset.chunk_count - 1
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stager.run)
            stager.demand.send(0, last)
            stager.demand.send(0, last - 1)
            assert await until(lambda: stager.health().demanded_chunks == [2], 10)
            assert await until(lambda: stager.health().demanded_chunks == [0], 60), \
                "the demanded chunks were never staged"
            assert stager.caches[0].is_staged(last) and stager.caches[0].is_staged(last - 1)
            nursery.cancel_scope.cancel()
    finally:
        close_stager(stager)


# -- real daemons ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool_source(tmp_path_factory) -> Path:
    """200 small samples and two files of several extents and chunks."""
    root = tmp_path_factory.mktemp("health") / "src"
    generate_tree(root / "train", 200, 20 * 1024, files_per_dir=100, seed=17)
    generate_large_files(root / "big", 2, 700 * 1024, seed=18)
    return root


@pytest.fixture(scope="module")
def pool_store(pool_source, tmp_path_factory) -> Path:
    return populate_store(pool_source, tmp_path_factory.mktemp("health-store") / "store", "ds",
                          "256K", "--no-fsync")


def file_owned_only_by(store: Path, names: list[str], node: int) -> Path:
    """A small file of dataset ds all of whose chunks only `node` owns (replicas 1)."""
    share = expected_shares(store, names, 1)[node]
    d = Store(store).open("ds").directory
    chunks = d.ext_chunk_view
    for row in d.file_rows():
        row = int(row)
        if 0 < d.size(row) < 64 << 10 and all(int(chunks[e]) in share for e in d.extents(row)):
            return Path(os.fsdecode(d.path(row)))
    raise AssertionError(f"no small file of node {names[node]}'s chunks")


@pytest.mark.usefixtures("daemon_guard")
def test_a_hung_peer_is_logged_as_the_stall_it_causes_and_shown_down(
        mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    """n1's processes stopped: n2's read of n1's chunk waits for the peer timeout (8 s)
    -> a stall past 1 s, logged naming peer n1; then n1 is marked down, which status
    and metrics show; the read itself is served by the store, bytes right.

    The stall must be seen (status, log, plain status) while the read still waits: the
    window is the peer timeout less the 1 s threshold. Those checks took ~2 s on the
    2-core VM at load 5; 8 s leaves them over 3 times that, for a much busier machine
    (20 s made the test 24 s long)."""
    cluster = Cluster(mounted, pool_store, tmp_path, 2, extra=(
        "--peer-timeout", "8", "--stall-seconds", "1"))
    for mount in cluster.mounts:
        wait_staged(dlfs_cli, mount)
    victim, reader = cluster.mounts
    rel = file_owned_only_by(pool_store, cluster.names, 0)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(
        (Path(reader.path) / "ds" / rel).read_bytes()), daemon=True)
    with stopped(daemon_pids_for(os.path.realpath(victim.path))):
        thread.start()
        stall = wait_for("the stalled read in n2's status", lambda: next(
            (s for s in health_of(dlfs_cli, reader).get("stalled", [])
             if s["waiting"] == "peer n1"), None))
        assert stall["path"] == f"ds/{rel}", stall
        wait_for("the stall in n2's log", lambda: f"read of ds/{rel} stalled" in reader.log_text())
        line = next(x for x in reader.log_text().splitlines() if f"read of ds/{rel} stalled" in x)
        assert "WARNING" in line and "waiting for peer n1" in line, line
        assert any(x.startswith(f"problem: read of ds/{rel} stalled") and "peer n1" in x
                   for x in plain_status(dlfs_cli, reader))
        # After the peer timeout: n1 is marked down and the read goes to the store.
        down = wait_for("n1 marked down", lambda: next(
            (p for p in health_of(dlfs_cli, reader).get("peers", [])
             if p["name"] == "n1" and p["down_processes"]), None))
        assert "unavailable" in down["down_why"], down
        thread.join(60)
    assert not thread.is_alive() and got == [(pool_source / rel).read_bytes()]
    health = health_of(dlfs_cli, reader)
    assert health["stalls_by_source"]["peer"] >= 1
    metrics = metrics_of(reader)
    assert metrics["dlfs_peer_down_marks_total"][(("peer", "n1"),)] >= 1
    assert metrics["dlfs_stalls_total"][(("waiting", "peer"),)] >= 1
    assert "dlfs_peers_down" in metrics and "dlfs_stalled_reads" in metrics


@pytest.mark.usefixtures("daemon_guard")
def test_a_store_read_slower_than_the_threshold_is_counted_and_logged_naming_the_store(
        mounted, tmp_path, dlfs_cli):
    src = tmp_path / "src"
    generate_large_files(src, 1, 1 << 20, seed=3)
    store = populate_store(src, tmp_path / "store", "ds", "1M", "--no-fsync")
    rel = source_files(src)[0]
    # One 1 MiB extent at 128 KiB/s: its first read takes about 8 s.
    mount = mounted(store, "--store-bandwidth", "128K", "--stall-seconds", "1",
                    "--workers", "2")
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(
        (Path(mount.path) / "ds" / rel).read_bytes()), daemon=True)
    thread.start()
    try:
        stall = wait_for("the stalled read in status", lambda: next(
            iter(health_of(dlfs_cli, mount).get("stalled", [])), None))
        assert stall == {**stall, "path": f"ds/{rel}", "waiting": "store"}, stall
    finally:
        thread.join(120)
    assert not thread.is_alive() and got == [(src / rel).read_bytes()]
    log_line = wait_for("the stall in the log", lambda: next(
        (x for x in mount.log_text().splitlines() if f"read of ds/{rel} stalled" in x), None))
    assert "WARNING" in log_line and "waiting for the store" in log_line, log_line
    health = wait_for("the stall counted", lambda: (
        h := health_of(dlfs_cli, mount))["stalls_by_source"]["store"] >= 1 and h)
    assert health["stalls_total"] >= 1
    assert metrics_of(mount)["dlfs_stalls_total"][(("waiting", "store"),)] >= 1
    # Over now: history, not a problem.
    lines = wait_for("the stall to be over", lambda: (
        x := plain_status(dlfs_cli, mount)) and not any(line.startswith("problem:")
                                                        for line in x) and x)
    assert any(line.startswith("stalls: ") for line in lines), lines
    # And the job's summary at unmount says so too.
    result = dlfs_cli("umount", mount.path)
    assert result.returncode == 0, describe_result(result)
    assert any("summary: stalls: " in x for x in mount.log_text().splitlines())


@pytest.mark.usefixtures("daemon_guard")
def test_a_pool_of_one_shows_a_chunk_it_cannot_stage_and_chunks_over_its_limit(
        mounted, tmp_path, dlfs_cli):
    src = tmp_path / "src"
    generate_tree(src, 40, 40 * 1024, files_per_dir=40, seed=5)
    store = populate_store(src, tmp_path / "store", "ds", "256K", "--no-fsync")
    d = Store(store).open("ds")
    assert d.chunk_count >= 4
    with open(d.chunk_path(0), "r+b") as f:  # a bad store copy of chunk 0
        f.seek(CHUNK_HEADER_SIZE + 10)
        byte = f.read(1)
        f.seek(CHUNK_HEADER_SIZE + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    mount = mounted(store, "--cache-dir", str(tmp_path / "cache"), "--cache-limit", "600K",
                    "--workers", "2")

    def problems() -> list[str]:
        found = [x for x in plain_status(dlfs_cli, mount) if x.startswith("problem:")]
        return found if len(found) == 2 else []

    lines = wait_for("two problem lines", problems)
    assert any("ds: cannot stage 1 chunk, e.g. chunk 0:" in x and "checksum mismatch" in x
               for x in lines), lines
    assert any("owned chunks" in x and "over --cache-limit 600.0 KiB" in x for x in lines), lines
    metrics = metrics_of(mount)
    assert metrics["dlfs_stage_failing_chunks"][(("dataset", "ds"),)] == 1
    assert metrics["dlfs_stage_over_limit_chunks"][(("dataset", "ds"),)] >= 1
    assert metrics["dlfs_stage_errors_total"][()] >= 1


NEW_SERIES = ("dlfs_stall_threshold_seconds", "dlfs_stalled_reads", "dlfs_stalls_total",
              "dlfs_oldest_read_seconds", "dlfs_peers_down", "dlfs_peers_with_bad_copies",
              "dlfs_stage_over_limit_chunks", "dlfs_stage_over_limit_bytes",
              "dlfs_stage_demanded_chunks", "dlfs_stage_failing_chunks",
              "dlfs_stage_errors_total", "dlfs_stage_paused")


@pytest.mark.usefixtures("daemon_guard")
def test_a_healthy_pool_shows_no_problem_and_exports_the_health_series(
        mounted, pool_store, pool_source, tmp_path, dlfs_cli):
    cluster = Cluster(mounted, pool_store, tmp_path, 2)
    for mount in cluster.mounts:
        wait_staged(dlfs_cli, mount)
        read_and_compare(mount, pool_source, source_files(pool_source))
    for mount in cluster.mounts:
        lines = plain_status(dlfs_cli, mount)
        assert not [x for x in lines if x.startswith(("problem:", "stalls:"))], lines
        health = health_of(dlfs_cli, mount)
        assert health["stalled_reads"] == 0 and health["stalls_total"] == 0
        assert health["peers_down"] == 0 and health["peers"] == []
        assert health["staging"]["copy_errors"] == 0
        metrics = metrics_of(mount)
        missing = [name for name in NEW_SERIES if name not in metrics]
        assert not missing, f"metrics lack {missing}"
        assert metrics["dlfs_stalled_reads"][()] == 0
        assert metrics["dlfs_stall_threshold_seconds"][()] == 10


def test_a_peer_server_short_of_its_processes_is_a_problem_line():
    """Fewer server processes than configured: a slot waits out a crash loop's
    back-off. All running (restarted or not), or no forked servers at all: nothing."""
    assert peer_server_problems(None) == [] and peer_server_problems({}) == []
    assert peer_server_problems({"processes": 4, "configured": 4, "restarts": 9}) == []
    assert peer_server_problems({"reads_served": 10}) == []  # loops in the main process
    lines = peer_server_problems({"processes": 3, "configured": 4, "restarts": 7})
    assert lines == ["problem: peer server: 3 of 4 processes running, 7 restarted since "
                     "mount (a server keeps dying soon after it starts: the log says why)"]
    status_lines = plain_lines({"mountpoint": "/m", "store": "/s", "pid": 1, "datasets": [],
                                "peer_server": {"processes": 0, "configured": 1,
                                                "restarts": 3}})
    assert status_lines[-1].startswith("problem: peer server: 0 of 1 processes running")

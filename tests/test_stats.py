"""I/O counters, `.dlfs/` live view, trace, report and job summary through real mounts.

The workload is scripted with O_DIRECT opens: the kernel then hands every
pread to the daemon as exactly one READ of exactly that offset and size (no
page cache, no read-ahead), so every counter has one right value. The
expected values come from the script by the documented rules (sequential =
starts where the previous read of the file ended, or at 0 after an open),
and the headline numbers are also spelled out by hand.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from pagecache import missing_pages_fd, pinned

from dlfs.obs.statsview import text_summary
from dlfs.obs.traceclient import COLUMNS
from dlfsd.obs.control import SNAPSHOT_FRESH

pytestmark = pytest.mark.usefixtures("daemon_guard")

SIZES = {"big.bin": 1 << 20, "mid.bin": 300_000, "small.bin": 10, "sub/child.bin": 200_000,
         "untouched.bin": 5000}
# (op, file[, offset, size]) in issue order, per process.
MAIN_STEPS = [
    ("open", "big.bin"), ("read", "big.bin", 0, 131072), ("read", "big.bin", 131072, 131072),
    ("read", "big.bin", 500_000, 4096), ("read", "big.bin", 504_096, 8192),
    ("close", "big.bin"),
    ("open", "mid.bin"), ("read", "mid.bin", 7, 1000), ("read", "mid.bin", 1007, 1000),
    ("close", "mid.bin"),
    ("open", "mid.bin"), ("read", "mid.bin", 0, 1000), ("close", "mid.bin"),
    ("open", "small.bin"), ("close", "small.bin"),
]
CHILD_STEPS = [
    ("open", "sub/child.bin"), ("read", "sub/child.bin", 0, 65536),
    ("read", "sub/child.bin", 65536, 65536), ("read", "sub/child.bin", 3, 100),
    ("close", "sub/child.bin"),
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def stats_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("stats-src")
    for i, (rel, size) in enumerate(SIZES.items()):
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i + 1]) * size)
    return store_with(src, "ds", "256K")


# -- the workload and its expected counters ---------------------------------------------
def run_steps(root: Path, steps: list[tuple]) -> None:
    fds = {}
    for op, name, *args in steps:
        if op == "open":
            fds[name] = os.open(root / "ds" / name, os.O_RDONLY | os.O_DIRECT)
        elif op == "read":
            offset, size = args
            got = os.pread(fds[name], size, offset)
            assert len(got) == size, (name, offset, size, len(got))
        else:
            os.close(fds.pop(name))


def join_or_kill(procs: list, timeout: float) -> list[int | None]:
    """Wait for forked processes; kill and reap any still running by then (also when the
    caller fails meanwhile). Their exit codes (negative: killed by that signal)."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 0))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs]


def run_workload(root: Path) -> int:
    """MAIN_STEPS here, CHILD_STEPS in a forked process at the same time; the child's pid."""
    child = multiprocessing.get_context("fork").Process(target=run_steps,
                                                        args=(root, CHILD_STEPS))
    child.start()
    try:
        run_steps(root, MAIN_STEPS)
    finally:
        exitcodes = join_or_kill([child], 60)
    assert exitcodes == [0], "the child's steps failed or hung"
    return child.pid


def expected_counters(step_lists: list[list[tuple]]) -> dict:
    """Counters per the documented rules, per file and for the dataset."""
    files: dict[str, dict] = {}
    total = {"opens": 0, "reads": 0, "bytes": 0, "sequential_reads": 0, "sizes": []}
    for steps in step_lists:
        last_end: dict[str, int] = {}
        for op, name, *args in steps:
            f = files.setdefault(name, {"opens": 0, "reads": 0, "bytes": 0})
            if op == "open":
                f["opens"] += 1
                total["opens"] += 1
                last_end[name] = 0
            elif op == "read":
                offset, size = args
                f["reads"] += 1
                f["bytes"] += size
                total["reads"] += 1
                total["bytes"] += size
                total["sizes"].append(size)
                total["sequential_reads"] += offset == 0 or last_end[name] == offset
                last_end[name] = offset + size
    return {"files": files, **total}


def log2_hist(values: list[int]) -> list[int]:
    hist = [0] * 32
    for v in values:
        hist[min(v.bit_length(), 31)] += 1
    return hist


def read_json(path: Path) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.read())


def check_counters(snapshot: dict, expected: dict, before_ns: int, after_ns: int) -> None:
    ds = snapshot["datasets"]["ds"]
    assert (ds["opens"], ds["reads"], ds["bytes"]) == (
        expected["opens"], expected["reads"], expected["bytes"])
    assert ds["sequential_reads"] == expected["sequential_reads"]
    assert ds["random_reads"] == expected["reads"] - expected["sequential_reads"]
    assert ds["read_size_hist"] == log2_hist(expected["sizes"])
    assert sum(ds["read_latency_us_hist"]) == expected["reads"]
    assert ds["read_latency_ns_sum"] > 0
    assert ds["sources"]["store"] == {"bytes": expected["bytes"], "reads": expected["reads"],
                                      "latency_ns_sum": ds["sources"]["store"]["latency_ns_sum"]}
    assert ds["sources"]["local"]["bytes"] == ds["sources"]["peer"]["bytes"] == 0
    assert ds["files_touched"] == len(expected["files"])
    got_files = {f["path"]: f for f in ds["top_files"]}
    assert set(got_files) == set(expected["files"])
    for name, want in expected["files"].items():
        got = got_files[name]
        assert (got["opens"], got["reads"], got["bytes"]) == (
            want["opens"], want["reads"], want["bytes"]), name
        assert before_ns - 1e9 <= got["first_access_ns"] <= got["last_access_ns"] \
            <= after_ns + 1e9, name
    mount = snapshot["mount"]
    assert (mount["opens"], mount["reads"], mount["bytes"]) == (
        expected["opens"], expected["reads"], expected["bytes"])


# -- tests ----------------------------------------------------------------------------------
def test_expected_model_matches_hand_count():
    e = expected_counters([MAIN_STEPS, CHILD_STEPS])
    assert (e["opens"], e["reads"], e["bytes"], e["sequential_reads"]) == (5, 10, 408_604, 7)


def test_counters_equal_the_scripted_workload(mounted, stats_store):
    m = mounted(stats_store, "--count-opens")
    assert len(m.pids) > 1, "the default mode must run several daemon processes"
    before = time.time_ns()
    run_workload(m.path)
    after = time.time_ns()
    snapshot = read_json(m.path / ".dlfs" / "stats.json")
    # main + workers serve FUSE (and add into the counters); one more answers `dlfs trace`
    assert snapshot["enabled"] and snapshot["processes"] == len(m.pids) - 1
    assert snapshot["opens_counted"] is True
    check_counters(snapshot, expected_counters([MAIN_STEPS, CHILD_STEPS]), before, after)


def test_counters_exact_with_concurrent_readers_of_one_file(mounted, stats_store):
    """Several processes hammer one file at once: per-file and dataset counts stay exact."""
    m = mounted(stats_store, "--count-opens")
    readers, reads_each, size = 4, 150, 4096
    steps = [("open", "big.bin")] + [("read", "big.bin", (i * 7919 % 256) * size, size)
                                     for i in range(reads_each)] + [("close", "big.bin")]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=run_steps, args=(m.path, steps)) for _ in range(readers)]
    try:
        for p in procs:
            p.start()
    finally:
        exitcodes = join_or_kill([p for p in procs if p.pid is not None], 120)
    assert exitcodes == [0] * readers
    ds = read_json(m.path / ".dlfs" / "stats.json")["datasets"]["ds"]
    assert (ds["opens"], ds["reads"], ds["bytes"]) == (
        readers, readers * reads_each, readers * reads_each * size)
    assert ds["sequential_reads"] + ds["random_reads"] == readers * reads_each
    big = {f["path"]: f for f in ds["top_files"]}["big.bin"]
    assert (big["opens"], big["reads"], big["bytes"]) == (
        readers, readers * reads_each, readers * reads_each * size)


def test_trace_holds_exactly_the_operations_issued(mounted, stats_store, dlfs_cli, tmp_path):
    m = mounted(stats_store, "--count-opens")
    result = dlfs_cli("trace", "start", m.path)
    assert result.returncode == 0, result.stderr
    child_pid = run_workload(m.path)
    out = tmp_path / "trace.csv"
    result = dlfs_cli("trace", "stop", m.path, "-o", out)
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout

    lines = out.read_text().splitlines()
    assert lines[0].startswith("# dlfs-trace v1 ") and "dropped=0" in lines[0]
    assert tuple(lines[1].split(",")) == COLUMNS
    rows = [dict(zip(COLUMNS, line.split(","), strict=True)) for line in lines[2:]]
    data = [r for r in rows if r["op"] in ("open", "read", "release")]

    def issued(steps):
        names = {"close": "release"}
        return [(names.get(op, op), "ds/" + name, *(args or [0, 0]))
                for op, name, *args in steps]

    def in_order(ops):  # the kernel sends RELEASE after close() returns: it may trail
        return [op for op in ops if op[0] != "release"], sorted(op for op in ops
                                                               if op[0] == "release")

    for pid, steps in ((os.getpid(), MAIN_STEPS), (child_pid, CHILD_STEPS)):
        got = [(r["op"], r["path"], int(r["offset"]), int(r["size"]))
               for r in data if int(r["pid"]) == pid]
        assert in_order(got) == in_order(issued(steps)), pid
    assert len(data) == len(MAIN_STEPS) + len(CHILD_STEPS), "operations of unknown pid"
    assert all(int(r["uid"]) == os.getuid() for r in data)
    assert all(r["source"] == "store" and int(r["latency_ns"]) > 0
               for r in data if r["op"] == "read")
    times = [int(r["time_ns"]) for r in rows]
    assert times == sorted(times)
    # The trace is off again: more reads are counted but not traced.
    run_steps(m.path, [("open", "small.bin"), ("read", "small.bin", 0, 10),
                       ("close", "small.bin")])
    status = dlfs_cli("trace", "status", m.path)
    assert "not tracing" in status.stdout and f"{len(rows)} records" in status.stdout


def test_kernel_opens_by_default_reads_counted_and_traced_with_their_pid(
        mounted, stats_store, dlfs_cli, tmp_path):
    """Default mount (no --count-opens): the kernel opens files without the daemon,
    so opens stay 0, every read is still counted, and the trace names the process
    of each read from the request itself."""
    m = mounted(stats_store)
    assert dlfs_cli("trace", "start", m.path).returncode == 0
    before = time.time_ns()
    child_pid = run_workload(m.path)
    after = time.time_ns()
    out = tmp_path / "trace.csv"
    assert dlfs_cli("trace", "stop", m.path, "-o", out).returncode == 0
    expected = expected_counters([MAIN_STEPS, CHILD_STEPS])
    snapshot = read_json(m.path / ".dlfs" / "stats.json")
    assert snapshot["opens_counted"] is False
    assert "opens not counted" in text_summary(snapshot)[0]
    ds = snapshot["datasets"]["ds"]
    assert (ds["opens"], ds["reads"], ds["bytes"], ds["sequential_reads"]) == (
        0, expected["reads"], expected["bytes"], expected["sequential_reads"])
    # small.bin was only opened: with kernel opens the daemon never saw it
    assert ds["files_touched"] == sum(f["reads"] > 0 for f in expected["files"].values())
    assert before <= ds["first_access_ns"] <= ds["last_access_ns"] <= after
    lines = out.read_text().splitlines()
    rows = [dict(zip(COLUMNS, line.split(","), strict=True)) for line in lines[2:]]
    assert not [r for r in rows if r["op"] in ("open", "release")]
    for pid, steps in ((os.getpid(), MAIN_STEPS), (child_pid, CHILD_STEPS)):
        got = [(r["path"], int(r["offset"]), int(r["size"]))
               for r in rows if r["op"] == "read" and int(r["pid"]) == pid]
        assert got == [("ds/" + name, *args) for op, name, *args in steps if op == "read"]


@pytest.mark.parametrize("count_opens", [False, True])
def test_page_cache_hits_never_reach_the_daemon(mounted, stats_store, dlfs_cli, tmp_path,
                                                count_opens):
    """A file read a second time comes from the page cache; by default the daemon
    sees nothing of it at all (no open, no read), with --count-opens only the open."""
    m = mounted(stats_store, *(["--count-opens"] if count_opens else []))
    path = m.path / "ds" / "mid.bin"
    expected = bytes([2]) * SIZES["mid.bin"]
    with open(path, "rb", buffering=0) as cold:  # one open, kept for mincore below
        assert cold.read() == expected  # cold: reads reach us
        # This VM's DAMON pageout may drop fresh pages; then the daemon is rightly asked
        # again. Warm them until the kernel holds them all (reads through the same open).
        for _ in range(5):
            if not missing_pages_fd(cold.fileno()):
                break
            assert os.pread(cold.fileno(), SIZES["mid.bin"], 0) == expected
        # Pinned from here on: even checked resident, a page could be evicted between the
        # check and the warm read (the full suite once saw exactly that one stray read).
        with pinned(cold.fileno()):
            # A cold-pass request still in flight would show up in the warm trace:
            # wait until the counters hold the whole pass.
            deadline = time.monotonic() + 10
            while read_json(m.path / ".dlfs" / "stats.json")["datasets"]["ds"]["bytes"] \
                    < SIZES["mid.bin"] and time.monotonic() < deadline:
                time.sleep(0.05)
            before = read_json(m.path / ".dlfs" / "stats.json")["datasets"]["ds"]["bytes"]
            assert before >= SIZES["mid.bin"], before  # the cold pass was counted whole
            assert not missing_pages_fd(cold.fileno()), "pinned pages are not resident"
            assert dlfs_cli("trace", "start", m.path).returncode == 0
            assert path.read_bytes() == expected  # warm
            out = tmp_path / "trace.csv"
            assert dlfs_cli("trace", "stop", m.path, "-o", out).returncode == 0
    rows = [dict(zip(COLUMNS, line.split(","), strict=True))
            for line in out.read_text().splitlines()[2:]]
    ops = sorted(r["op"] for r in rows if int(r["pid"]) == os.getpid())
    assert ops == (["open", "release"] if count_opens else []), rows
    ds = read_json(m.path / ".dlfs" / "stats.json")["datasets"]["ds"]
    assert ds["opens"] == (2 if count_opens else 0)
    assert ds["bytes"] == before  # the warm pass read nothing from the daemon


def test_trace_ring_keeps_the_newest_and_counts_the_dropped(mounted, stats_store, dlfs_cli,
                                                            tmp_path):
    m = mounted(stats_store, "--workers", "1", "--count-opens", "--trace-capacity", "16")
    assert dlfs_cli("trace", "start", m.path).returncode == 0
    fd = os.open(m.path / "ds" / "big.bin", os.O_RDONLY | os.O_DIRECT)
    for i in range(50):
        os.pread(fd, 4096, i * 4096)
    os.close(fd)
    out = tmp_path / "t.csv"
    assert dlfs_cli("trace", "stop", m.path, "-o", out).returncode == 0
    lines = out.read_text().splitlines()
    rows = [dict(zip(COLUMNS, line.split(","), strict=True)) for line in lines[2:]]
    assert len(rows) == 16
    assert [(r["op"], int(r["offset"])) for r in rows] == \
        [("read", i * 4096) for i in range(35, 50)] + [("release", 0)]
    dropped = int(lines[0].split("dropped=")[1].split()[0])
    assert dropped >= 50 + 2 - 16  # open + 50 reads + release, plus any lookups


def test_stats_json_and_metrics_parse(mounted, stats_store):
    from prometheus_client.parser import text_string_to_metric_families

    m = mounted(stats_store, "--count-opens")
    run_steps(m.path, MAIN_STEPS)
    expected = expected_counters([MAIN_STEPS])
    snapshot = read_json(m.path / ".dlfs" / "stats.json")
    assert snapshot["format"] == "dlfs-stats" and snapshot["version"] == 1
    text = (m.path / ".dlfs" / "metrics").read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    ds = snapshot["datasets"]["ds"]
    label = (("dataset", "ds"),)
    assert samples[("dlfs_reads_total", label)] == ds["reads"] == expected["reads"]
    assert samples[("dlfs_opens_total", label)] == ds["opens"] == expected["opens"]
    assert samples[("dlfs_read_bytes_total", label)] == ds["bytes"] == expected["bytes"]
    assert samples[("dlfs_source_bytes_total", (("dataset", "ds"), ("source", "store")))] \
        == expected["bytes"]
    assert families["dlfs_read_size_bytes"].type == "histogram"
    assert samples[("dlfs_read_size_bytes_count", label)] == expected["reads"]
    assert samples[("dlfs_read_size_bytes_bucket", (("dataset", "ds"), ("le", "+Inf")))] \
        == expected["reads"]
    buckets = {float(s.labels["le"]): s.value for s in families["dlfs_read_size_bytes"].samples
               if s.name.endswith("_bucket")}
    # Cumulative: `le` 2**b - 1 counts the reads of at most that many bytes.
    sizes = expected["sizes"]
    bounds = [le for le in buckets if le != float("inf")]
    assert bounds and max(bounds) >= max(sizes), buckets
    for le in bounds:
        assert buckets[le] == sum(size <= le for size in sizes), le
    assert all(name.startswith("dlfs_") for name in families)


def test_control_dir_is_hidden_and_read_only(mounted, stats_store):
    m = mounted(stats_store)
    assert os.listdir(m.path) == ["ds"]
    # "order": the look-ahead's socket name (docs/ORDER.md)
    assert sorted(os.listdir(m.path / ".dlfs")) == ["metrics", "order", "stats.json"]
    for attempt in (lambda: os.open(m.path / ".dlfs" / "stats.json", os.O_WRONLY),
                    lambda: os.open(m.path / ".dlfs" / "new", os.O_WRONLY | os.O_CREAT),
                    lambda: os.unlink(m.path / ".dlfs" / "metrics")):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    # A later read sees a later snapshot (kernel opens: one per SNAPSHOT_FRESH per process).
    first = read_json(m.path / ".dlfs" / "stats.json")["time_ns"]
    time.sleep(SNAPSHOT_FRESH + 0.1)
    assert read_json(m.path / ".dlfs" / "stats.json")["time_ns"] > first


def test_report_writes_every_plot(mounted, stats_store, dlfs_cli, tmp_path):
    m = mounted(stats_store, "--count-opens")
    assert dlfs_cli("trace", "start", m.path).returncode == 0
    run_workload(m.path)
    trace = tmp_path / "trace.csv"
    assert dlfs_cli("trace", "stop", m.path, "-o", trace).returncode == 0
    out = tmp_path / "report"
    result = dlfs_cli("report", trace, "-o", out)
    assert result.returncode == 0, result.stderr
    pngs = ["spatial.png", "temporal.png", "request_sizes.png", "sources.png",
            "throughput.png", "top_files.png"]
    index = (out / "index.html").read_text()
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
        assert f'src="{name}"' in index
    summary = (out / "summary.txt").read_text()
    expected = expected_counters([MAIN_STEPS, CHILD_STEPS])
    random_pct = 100 * (expected["reads"] - expected["sequential_reads"]) / expected["reads"]
    assert f"files touched: {len(expected['files'])}\n" in summary
    assert f"bytes read: {expected['bytes']:,} (" in summary
    assert f"random reads: {random_pct:.1f}% " in summary
    assert summary in result.stdout + "\n" or summary.splitlines()[0] in result.stdout


def test_summary_file_written_at_unmount(mounted, stats_store, dlfs_cli, tmp_path):
    summary = tmp_path / "job" / "dlfs-summary.json"
    summary.parent.mkdir()
    m = mounted(stats_store, "--summary-file", str(summary), "--count-opens")
    before = time.time_ns()
    run_workload(m.path)
    after = time.time_ns()
    assert not summary.exists()
    assert dlfs_cli("umount", m.path).returncode == 0
    data = read_json(summary)
    expected = expected_counters([MAIN_STEPS, CHILD_STEPS])
    check_counters(data, expected, before, after)
    assert data["summary"] and data["summary"][0].startswith(
        f"ds: {len(expected['files'])} files touched, {expected['opens']} opens, "
        f"{expected['reads']} reads, "), data["summary"]


def test_no_stats_mount_counts_nothing(mounted, stats_store, dlfs_cli):
    m = mounted(stats_store, "--no-stats")
    run_steps(m.path, MAIN_STEPS)
    assert read_json(m.path / ".dlfs" / "stats.json")["enabled"] is False
    assert "dlfs_stats_enabled 0" in (m.path / ".dlfs" / "metrics").read_text()
    result = dlfs_cli("trace", "start", m.path)
    assert result.returncode == 1
    assert result.stderr.startswith("dlfs: error: ") and len(result.stderr.splitlines()) == 1
    table = dlfs_cli("stats", m.path)
    assert table.returncode == 0 and "--no-stats" in table.stdout


def test_stats_cli_table_and_json(mounted, stats_store, dlfs_cli):
    m = mounted(stats_store)
    run_steps(m.path, MAIN_STEPS)
    table = dlfs_cli("stats", m.path)
    assert table.returncode == 0, table.stderr
    assert "ds" in table.stdout and "median req" in table.stdout
    raw = dlfs_cli("stats", m.path, "--json")
    assert json.loads(raw.stdout)["datasets"]["ds"]["reads"] == \
        expected_counters([MAIN_STEPS])["reads"]


def test_process_slabs_add_up_across_forks(stats_store):
    """Unit level: forked processes write their own slabs; one snapshot sees all of it."""
    from dlfs.store.store import Store
    from dlfsd.base.slots import ProcessSlot
    from dlfsd.obs.stats import SOURCE_PEER, Stats

    dataset = Store(stats_store).open("ds")
    row = dataset.directory.resolve(b"big.bin")
    stats = Stats(["ds"], [dataset.directory], ProcessSlot(3))
    children = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # child: its own slab, the shared per-file counters
            code = 1
            try:
                assert stats.slot.index in (1, 2)
                for i in range(1000):
                    stats.record_open(0, row)
                    stats.record_read(0, row, 0, 4096 + i % 2, 2000)
                    stats.record_source(0, SOURCE_PEER, 4096, 1000)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    for pid in children:
        assert os.waitpid(pid, 0)[1] == 0
    snap = stats.snapshot()["datasets"]["ds"]
    assert (snap["opens"], snap["reads"], snap["bytes"]) == (2000, 2000, 2000 * 4096 + 1000)
    # (sequential or random depends on how the two children interleave on the one file)
    assert snap["sequential_reads"] + snap["random_reads"] == 2000
    assert snap["read_size_hist"][13] == 2000
    assert snap["sources"]["peer"] == {"bytes": 2000 * 4096, "reads": 2000,
                                       "latency_ns_sum": 2000 * 1000}
    assert snap["top_files"][0]["path"] == "big.bin"
    stats.close()

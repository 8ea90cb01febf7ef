"""`dlfs trace` on a real mount: the capacity it promises, an output path it cannot
write, and trace files as people leave them (a trailing blank line)."""

from __future__ import annotations

import os

from dlfs.obs.traceclient import COLUMNS, read_trace_csv


def test_the_trace_capacity_goes_to_the_processes_that_serve(mounted, store_with, tmp_path,
                                                             dlfs_cli):
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(1 << 20))
    m = mounted(store_with(src, "ds", "256K", tmp_path / "store"),
                "--workers", "2", "--trace-capacity", "16")
    assert dlfs_cli("trace", "start", m.path).returncode == 0
    fd = os.open(m.path / "ds" / "big.bin", os.O_RDONLY | os.O_DIRECT)
    try:
        for i in range(50):
            os.pread(fd, 4096, i * 4096)
    finally:
        os.close(fd)
    out = tmp_path / "t.csv"
    assert dlfs_cli("trace", "stop", m.path, "-o", out).returncode == 0
    lines = out.read_text().splitlines()
    header = dict(f.split("=") for f in lines[0].split() if "=" in f)
    assert int(header["capacity"]) == 16, lines[0]  # not 15: 5 for each of 3 processes
    rows = [dict(zip(COLUMNS, line.split(","), strict=True)) for line in lines[2:]]
    reads = [r for r in rows if r["op"] == "read"]
    assert len(rows) <= 16 and len(reads) >= 8  # a worker that served reads kept 8
    assert int(header["records"]) + int(header["dropped"]) >= 50


def test_stop_to_a_missing_directory_keeps_tracing_and_says_so(mounted, store_with, tmp_path,
                                                             dlfs_cli):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 5000)
    m = mounted(store_with(src, "ds", "256K", tmp_path / "store"))
    assert dlfs_cli("trace", "start", m.path).returncode == 0
    (m.path / "ds" / "a.bin").read_bytes()
    result = dlfs_cli("trace", "stop", m.path, "-o", tmp_path / "missing" / "t.csv")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
    assert "missing" in result.stderr and "still running" in result.stderr
    assert "not tracing" not in dlfs_cli("trace", "status", m.path).stdout
    out = tmp_path / "t.csv"
    assert dlfs_cli("trace", "stop", m.path, "-o", out).returncode == 0
    with open(out, "a") as f:
        f.write("\n")  # as an editor leaves it
    trace = read_trace_csv(out)
    assert "ds/a.bin" in trace.paths and trace.records.size >= 1
    assert sorted(os.listdir(tmp_path)).count("t.csv") == 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".t.csv.tmp")]

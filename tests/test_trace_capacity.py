"""The trace keeps as many records as it says: with worker processes the capacity is
split over the workers, which serve the requests, not over the main process too."""

from __future__ import annotations

import os

from dlfs.tracefile import COLUMNS


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

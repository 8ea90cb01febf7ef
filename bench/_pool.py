"""Helpers shared by the chunk-pool benchmarks (pool_read.py, staging.py)."""

from __future__ import annotations

import json
import secrets
import socket
import time
from pathlib import Path

from _common import run_dlfs


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_secret(path: Path) -> Path:
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def status(mountpoint: Path) -> dict:
    return json.loads(run_dlfs(["status", str(mountpoint), "--json"]).stdout)


def wait_staged(mountpoint: Path, timeout: float = 3600.0, poll: float = 0.05) -> float:
    """Block until every owned chunk of every dataset is staged; returns when (monotonic)."""
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        datasets = status(mountpoint)["datasets"]
        if all(d["staging"]["staged_chunks"] == d["staging"]["owned_chunks"] for d in datasets):
            return now
        if now > deadline:
            raise RuntimeError(f"staging of {mountpoint} did not finish in {timeout:.0f} s")
        time.sleep(poll)


def source_counts(mountpoint: Path) -> dict:
    """Per-source read counters, from a status written after now."""
    since = time.time()
    while True:
        s = status(mountpoint)
        if s["updated"] > since:
            return s["datasets"][0]["sources"]
        time.sleep(0.1)

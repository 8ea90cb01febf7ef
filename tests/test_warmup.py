"""`dlfs warmup`: a node's share staged before the job; the job's mounts adopt it."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import run_dlfs
from test_pool import free_ports, pool_source_tree, write_secret

from dlfs.store.format import CHUNK_HEADER_SIZE, chunk_path
from dlfs.store.store import Store

pytestmark = pytest.mark.usefixtures("daemon_guard")


@pytest.fixture(scope="module")
def warm_store(tmp_path_factory):
    from conftest import populate_store

    source = pool_source_tree(tmp_path_factory.mktemp("warm") / "src")
    return source, populate_store(source, tmp_path_factory.mktemp("warm-store") / "store",
                                  "ds", "256K", "--no-fsync")


def store_bytes(mount) -> int:
    out = subprocess.run(["cat", str(mount.path / ".dlfs" / "stats.json")],
                         capture_output=True, check=True).stdout
    return json.loads(out)["datasets"]["ds"]["sources"]["store"]["bytes"]


def read_all(mount, source) -> None:
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = path.relative_to(source)
        assert (mount.path / "ds" / rel).read_bytes() == path.read_bytes(), rel


def test_warmed_nodes_of_a_pool_read_nothing_from_the_store(mounted, warm_store, tmp_path):
    source, store = warm_store
    nodes = ",".join(f"n{i + 1}=127.0.0.1:{port}" for i, port in enumerate(free_ports(2)))
    for i in range(2):  # as `srun dlfs warmup` would on each node
        r = run_dlfs("warmup", "--store", store, "--cache-dir", tmp_path / f"cache-n{i + 1}",
                     "--nodes", nodes, "--node", f"n{i + 1}")
        assert r.returncode == 0 and "0 were staged already" in r.stdout, r.stderr
    again = run_dlfs("warmup", "--store", store, "--cache-dir", tmp_path / "cache-n1",
                     "--nodes", nodes, "--node", "n1")
    assert again.returncode == 0 and " 0 B copied" in again.stdout, again.stdout
    secret = write_secret(tmp_path / "secret")
    mounts = [mounted(store, "--cache-dir", str(tmp_path / f"cache-n{i + 1}"), "--nodes",
                      nodes, "--node", f"n{i + 1}", "--secret-file", str(secret))
              for i in range(2)]
    for mount in mounts:
        read_all(mount, source)
    assert [store_bytes(m) for m in mounts] == [0, 0]


def test_a_chunk_the_store_cannot_give_stops_the_warmup_with_one_line(warm_store, tmp_path):
    _, store = warm_store
    bad_store = tmp_path / "store"
    subprocess.run(["cp", "-a", str(store), str(bad_store)], check=True)
    dataset = Store(bad_store).open("ds")
    path = chunk_path(bad_store / "ds", 0)
    data = bytearray(path.read_bytes())
    data[CHUNK_HEADER_SIZE + 10] ^= 0xFF  # a flipped byte: the copy fails its check
    path.write_bytes(bytes(data))
    r = run_dlfs("warmup", "--store", bad_store, "--cache-dir", tmp_path / "cache",
                 "--stall-seconds", "2")
    assert r.returncode == 1 and "warm-up stalled: 1 chunks not staged" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    staged = {p.name for p in (tmp_path / "cache" / dataset.uuid.hex()).iterdir()
              if not p.name.startswith(".")}
    assert len(staged) == dataset.chunk_count - 1  # every good chunk, never the bad one

"""`dlfs doctor`: one line per check, what is wrong and what to do, exit 1 on any failure."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from pathlib import Path

import pytest
from conftest import describe_result
from trees import make_small_tree

from dlfs.store.format import MANIFEST_NAME


def free_port() -> int:
    """A port nothing listens on now: the OS picks it (it may be taken again later, but
    not by a fixed choice that another service on the machine happens to hold)."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_with) -> Path:
    src = tmp_path_factory.mktemp("doctor") / "src"
    make_small_tree(src, files=8)
    store = store_with(src, "ds")
    return store_with(src, "other", "256K", store)


def lines_of(result) -> dict[str, str]:
    """{check name: full line} of the doctor's report."""
    out = {}
    for line in result.stdout.splitlines()[:-1]:
        status, _, rest = line.partition("  ")
        out[rest.split(":", 1)[0].strip()] = line
        assert status.strip() in ("ok", "warn", "FAIL"), line
    return out


def test_healthy_node_passes(dlfs_cli, small_store, tmp_path):
    port = free_port()
    result = dlfs_cli("doctor", "--store", small_store, "--cache-dir", tmp_path / "cache",
                      "--port", str(port))
    assert result.returncode == 0, describe_result(result)
    checks = lines_of(result)
    for name in ("/dev/fuse", "fusermount3", "trio", "store", "dataset ds",
                 "dataset other", "cache dir", f"port {port}"):
        assert checks[name].startswith("ok"), checks.get(name, checks)
    assert result.stdout.splitlines()[-1] == "all checks passed"
    assert not (tmp_path / "cache").exists(), "doctor must not create the cache dir"


def test_missing_store_fails(dlfs_cli, tmp_path):
    result = dlfs_cli("doctor", "--store", tmp_path / "nosuch")
    assert result.returncode == 1
    assert lines_of(result)["store"].startswith("FAIL") and "nosuch" in result.stdout


def test_broken_dataset_is_named(dlfs_cli, small_store, tmp_path):
    broken = tmp_path / "store"
    shutil.copytree(small_store, broken)
    (broken / "ds" / MANIFEST_NAME).write_bytes(b"not a manifest")
    next((broken / "other" / "chunks").iterdir()).unlink()
    result = dlfs_cli("doctor", "--store", broken)
    assert result.returncode == 1
    checks = lines_of(result)
    assert checks["dataset ds"].startswith("FAIL") and "re-populate" in checks["dataset ds"]
    assert checks["dataset other"].startswith("FAIL") and "missing" in checks["dataset other"]


def test_busy_port_fails(dlfs_cli):
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))  # a port the OS gives us, held while the doctor runs
        sock.listen()
        busy = sock.getsockname()[1]
        result = dlfs_cli("doctor", "--port", str(busy))
    assert result.returncode == 1
    assert lines_of(result)[f"port {busy}"].startswith("FAIL")


def test_cache_dir_under_a_file_fails(dlfs_cli, tmp_path):
    (tmp_path / "afile").write_text("x")
    result = dlfs_cli("doctor", "--cache-dir", tmp_path / "afile" / "cache")
    assert result.returncode == 1
    assert "not a directory" in lines_of(result)["cache dir"]


def test_missing_fusermount_says_what_to_install(dlfs_cli, tmp_path):
    result = dlfs_cli("doctor", env={"PATH": str(tmp_path)})
    assert result.returncode == 1
    assert "install the fuse3 package" in lines_of(result)["fusermount3"]


def pipe_of_2_mib_allowed() -> bool:
    """Asked of the kernel directly: may this process make a 2 MiB pipe?"""
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 2 << 20)
        return True
    except PermissionError:
        return False
    finally:
        os.close(read_end)
        os.close(write_end)


def test_spliced_reads_check_says_what_this_node_allows(dlfs_cli):
    result = dlfs_cli("doctor")
    line = lines_of(result)["spliced reads"]
    if pipe_of_2_mib_allowed():
        assert line.startswith("ok") and "spliced from chunk files" in line, line
    else:
        assert line.startswith("warn") and "fs.pipe-max-size=2097152" in line, line
    assert result.returncode == 0, "a copying node still works: a warning, not a failure"


def test_a_pools_node_list_and_secret_are_checked(dlfs_cli, tmp_path):
    port = free_port()
    nodes = f"a=127.0.0.1:{port},b=127.0.0.1:{free_port()}"
    secret = tmp_path / "job.secret"
    secret.write_text("x" * 64)
    secret.chmod(0o600)
    result = dlfs_cli("doctor", "--nodes", nodes, "--node", "a", "--secret-file", secret)
    assert result.returncode == 0, describe_result(result)
    checks = lines_of(result)
    assert checks["nodes"].startswith("ok") and "this one is a (127.0.0.1:" in checks["nodes"]
    assert checks[f"port {port}"].startswith("ok")
    assert checks["secret file"].startswith("ok")

    secret.chmod(0o644)
    result = dlfs_cli("doctor", "--nodes", nodes, "--node", "c", "--secret-file", secret)
    assert result.returncode == 1
    checks = lines_of(result)
    assert checks["nodes"].startswith("FAIL") and "'c'" in checks["nodes"], checks["nodes"]
    assert checks["secret file"].startswith("FAIL") and "chmod 600" in checks["secret file"]


def test_a_slurm_port_range_reports_the_ports_in_use(dlfs_cli):
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))  # held while the doctor runs: inside the range it checks
        sock.listen()
        busy = sock.getsockname()[1]
        base = max(1024, busy - 5)
        result = dlfs_cli("doctor", "--port", str(base), "--port-span", "20")
    line = lines_of(result)[f"ports {base}-{base + 19}"]
    assert line.startswith("ok") and str(busy) in line and "in use" in line
    result = dlfs_cli("doctor", "--port", "65530", "--port-span", "20")
    assert result.returncode == 1
    assert lines_of(result)["ports 65530-65535"].startswith("FAIL")

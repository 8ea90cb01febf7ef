"""`dlfs ckpt-audit` (dlfsd.ckpt.audit) on a tier made by a real root mount.

The Slurm epilog deletes a checkpoint tier only when this says drained and not in
use: so a file not on the store yet, a mount still holding the tier, a file written
into tree/ behind the ledger's back, and a ledger that cannot be read must each keep
the tier (exit non-zero, one line naming the tier), and a tier flushed by the daemon
must come out drained (exit 0), or the epilog would never clean up.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import run_dlfs, tmpfs_at

pytestmark = pytest.mark.usefixtures("daemon_guard")

DRAINED, UNDRAINED, IN_USE, UNKNOWN = 0, 4, 5, 6  # the exit codes (dlfs --help)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("audit-src")
    (src / "x.bin").write_bytes(os.urandom(3000))
    return store_with(src, "ds", "64K")


def audit(cache: Path, store: Path | None = None, *extra: str) -> subprocess.CompletedProcess:
    more = ("--ckpt-store", str(store)) if store is not None else ()
    return run_dlfs("ckpt-audit", "--cache-dir", cache, *more, *extra)


def audit_json(cache: Path, store: Path) -> tuple[int, dict]:
    result = audit(cache, store, "--json")
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout + result.stderr
    return result.returncode, json.loads(lines[0])


def test_audit_follows_the_ledger_of_a_real_tier(mounted, small_store, tmp_path):
    cache, store = tmp_path / "cache", tmp_path / "ckstore"
    with tmpfs_at(store, "size=64m"):
        m = mounted(small_store, "--cache-dir", str(cache), "--ckpt-store", str(store))
        ro = subprocess.run(["mount", "-o", "remount,ro", str(store)], capture_output=True,
                            text=True)
        if ro.returncode:
            pytest.skip(f"cannot remount a tmpfs read-only here: {ro.stderr.strip()}")
        (m.path / "ckpt" / "step-1").mkdir()
        (m.path / "ckpt" / "step-1" / "w.pt").write_bytes(os.urandom(1 << 20))

        # Mounted, the store read-only: in use (the mount holds .lock), and undrained.
        code, seen = audit_json(cache, store)
        assert code == IN_USE, seen
        assert seen["in_use"] and seen["undrained"] == ["step-1/w.pt"], seen
        tier = Path(seen["tier"])
        assert tier.parent == cache / "ckpt" and (tier / "tree").is_dir()

        subprocess.run(["mount", "-o", "remount,rw", str(store)], check=True)
        flushed = run_dlfs("flush", m.path, "--timeout", "90")
        assert flushed.returncode == 0, flushed.stderr
        code, seen = audit_json(cache, store)
        assert (code, seen["in_use"], seen["undrained"]) == (IN_USE, True, []), seen

        assert run_dlfs("umount", m.path).returncode == 0
        plain = audit(cache, store)
        assert plain.returncode == DRAINED, plain.stdout + plain.stderr
        assert plain.stdout.startswith(f"drained {tier.name}: tier {tier} of checkpoint "
                                       f"store {store}"), plain.stdout
        whole = audit(cache)  # every tier of the cache: the same one
        assert (whole.returncode, whole.stdout) == (DRAINED, plain.stdout)

        # A link in the tree is never followed: files outside do not count.
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "elsewhere.bin").write_bytes(b"x")
        (tier / "tree" / "link").symlink_to(outside)
        assert audit(cache, store).returncode == DRAINED

        # A file written into tree/ behind the ledger's back: undrained, named.
        (tier / "tree" / "step-1" / "sneak.bin").write_bytes(b"not on the store")
        behind = audit(cache, store)
        assert behind.returncode == UNDRAINED, behind.stdout
        assert behind.stdout.startswith(f"undrained {tier.name}: ") \
            and "step-1/sneak.bin" in behind.stdout and str(tier) in behind.stdout
        (tier / "tree" / "step-1" / "sneak.bin").unlink()

        # A drained file changed locally (its mtime no longer the ledger's): undrained.
        os.utime(tier / "tree" / "step-1" / "w.pt", ns=(1, 1))
        assert audit(cache, store).returncode == UNDRAINED

        # The ledger cannot be read: unknown, the caller keeps the tier.
        for name in ("state.db-wal", "state.db-shm"):
            (tier / name).unlink(missing_ok=True)
        (tier / "state.db").write_bytes(b"this is not a database" * 100)
        broken = audit(cache, store)
        assert broken.returncode == UNKNOWN, broken.stdout + broken.stderr
        assert broken.stdout.startswith(f"unknown {tier.name}: ") and "state.db" in broken.stdout
        (tier / "state.db").unlink()
        assert audit(cache, store).returncode == UNKNOWN  # no ledger at all: unknown too


def test_audit_reads_only(tmp_path):
    """No tier, a missing cache dir: nothing is created (read-only), one line each."""
    cache = tmp_path / "cache"
    cache.mkdir()
    empty = audit(cache, tmp_path / "ckstore")
    assert (empty.returncode, empty.stdout.strip()) == (
        DRAINED, f"no checkpoint tier for checkpoint store {tmp_path / 'ckstore'} in "
                 f"{cache / 'ckpt'}")
    assert list(cache.iterdir()) == [] and not (tmp_path / "ckstore").exists()
    missing = audit(tmp_path / "nope")
    assert missing.returncode == 1
    assert missing.stderr.strip().startswith(f"dlfs: error: cache dir not found: "
                                             f"{tmp_path / 'nope'}")

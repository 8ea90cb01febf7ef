"""Shared fixtures: edge-case source trees, populated stores and real FUSE mounts.

Fixtures for other test modules:

- `edge_tree` (session): a `trees.EdgeTree` (source dir with thousands of files and
  every awkward case; see tests/trees.py); path-like (`os.fspath`, `/`), `.root` is
  the Path. Read-only: never modify it.
- `edge_nodes` (session): `trees.describe_tree(edge_tree.root)`, the expected view.
- `edge_store` (session): a store with `edge_tree` populated as dataset "edge"
  (--chunk-size 256K). Read-only: copy it (`store_with`) to corrupt something.
- `store_with(tree, name="ds", chunk_size="256K", store=None, *extra)`: populate
  with the real `dlfs populate` CLI into a fresh (or the given) store; returns the store.
- `mounted(store, *mount_args, mountpoint=None)`: `dlfs mount MP --store S` in the
  background; returns a `Mount` (path-like; `.path`, `.pid`, `.pids`, `.log`;
  `m / "ds/file"` -> Path, `m / b"ds/file"` -> bytes). Teardown always unmounts
  (`dlfs umount`, then `fusermount3 -u -z`, then `umount -l`) and kills any daemon
  left for MP, even when the test failed. `mounted.try_mount(..., env=None)` returns
  the CompletedProcess instead of failing; `mounted.new_mountpoint()` makes an empty
  directory; `mounted.adopt(MP)` tears down a mount another `dlfs` makes at MP.
- `dlfs_cli(*args, env=None, timeout=120)`: run the `dlfs` CLI, return CompletedProcess.
- `sysproc`: /proc-based helpers (fstype_at, pid_alive, wait_dead, kill_and_reap,
  daemon_pids_for, dlfsd_processes, dlfs_argv).
- `daemon_guard`: after the test, fails if a `dlfsd` started for a mountpoint of this
  session is still running (and kills it).
- `tmpfs_at(path, options)`, `overlayfs_at(base)` (context managers): a tmpfs, an
  overlay file system (a container's /tmp) for the block, unmounted even when the
  test fails; they skip where they cannot be mounted.

Feature probes of the file system under a test (splice, page-cache residency,
cachestat) live in tests/pagecache.py.

Real mounts need /dev/fuse and fusermount3: without them the mount tests skip,
except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from trees import TEST_CHUNK_SIZE, EdgeTree, describe_tree, make_edge_tree

_VENV_DLFS = Path(sys.executable).with_name("dlfs")
DLFS = [str(_VENV_DLFS)] if _VENV_DLFS.exists() else [sys.executable, "-m", "dlfs.cli.main"]

# A suite started in the background of a script (`cmd &`, nohup) inherits SIGINT
# ignored, and so would every process it starts: `dlfs` would not see the Ctrl-C the
# interrupt tests send it. A handler of our own is reset to the default across exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Mountpoints a live Mounter is responsible for; daemons of others are leftovers.
_ACTIVE_MOUNTPOINTS: set[str] = set()


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_fuse() -> None:
    """Skip (or, in CI, fail) when real FUSE mounts are impossible here."""
    problems = []
    if not os.path.exists("/dev/fuse"):
        problems.append("/dev/fuse does not exist")
    else:
        try:
            os.close(os.open("/dev/fuse", os.O_RDWR))
        except OSError as err:
            problems.append(f"cannot open /dev/fuse: {err.strerror}")
    if shutil.which("fusermount3") is None:
        problems.append("fusermount3 is not on PATH (install fuse3)")
    if problems:
        message = "real-mount tests need FUSE: " + "; ".join(problems)
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)


def run_dlfs(*args: str | os.PathLike, env: dict | None = None, timeout: float = 120,
             **kwargs) -> subprocess.CompletedProcess:
    """Run the real `dlfs` CLI; never raises on a non-zero exit."""
    full_env = dict(os.environ)
    full_env.pop("DLFS_READY_FD", None)
    if env:
        full_env.update(env)
    return subprocess.run([*DLFS, *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, **kwargs)


def describe_result(result: subprocess.CompletedProcess) -> str:
    return (f"`{' '.join(map(str, result.args))}` exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout}--- stderr ---\n{result.stderr}")


def populate_store(tree: Path | EdgeTree, store: Path, name: str = "ds",
                   chunk_size: str | int = "256K", *extra: str) -> Path:
    source = tree.root if isinstance(tree, EdgeTree) else tree
    result = run_dlfs("populate", source, "--store", store, "--name", name,
                      "--chunk-size", str(chunk_size), *extra)
    if result.returncode != 0:
        pytest.fail("populate failed: " + describe_result(result))
    return store


# -- processes and mounts, read from /proc (never through the code under test) ----
def _unescape_mountinfo(raw: bytes) -> bytes:
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] == 0x5C and raw[i + 1 : i + 4].isdigit() and len(raw[i + 1 : i + 4]) == 3:
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return bytes(out)


def mounts_by_path() -> dict[str, str]:
    """{mountpoint: fstype} of every mount this process sees (the top one wins)."""
    found = {}
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            left, _, right = line.partition(b" - ")
            path = os.fsdecode(_unescape_mountinfo(left.split()[4]))
            found[path] = right.split()[0].decode()
    return found


def fstype_at(path: str | Path) -> str | None:
    return mounts_by_path().get(str(path))


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.01)
    return not pid_alive(pid)


def dlfsd_processes() -> dict[int, str]:
    """{pid: mountpoint} of every running `python -m dlfsd --config JSON` process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"dlfsd" not in argv and not any(a.endswith(b"/dlfsd") for a in argv):
            continue
        mountpoint = ""
        if b"--config" in argv:
            i = argv.index(b"--config")
            with contextlib.suppress(IndexError, ValueError, KeyError):
                mountpoint = json.loads(argv[i + 1])["mountpoint"]
        if pid_alive(int(entry)):
            found[int(entry)] = mountpoint
    return found


def daemons_under(root: Path) -> dict[int, str]:
    prefix = str(root).rstrip("/") + "/"
    return {pid: mp for pid, mp in dlfsd_processes().items() if mp.startswith(prefix)}


def daemon_pids_for(mountpoint: str | Path) -> list[int]:
    """Every process of the daemon serving `mountpoint` (the main one and its workers)."""
    return sorted(pid for pid, mp in dlfsd_processes().items() if mp == str(mountpoint))


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def main_daemon_pids(mountpoint: str | Path) -> list[int]:
    """The daemon processes for `mountpoint` that were not forked by another of them."""
    pids = daemon_pids_for(mountpoint)
    return [pid for pid in pids if parent_pid(pid) not in pids]


def kill_and_reap(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_dead(pid, 10)


def kill_daemon_of(mount) -> None:
    """SIGKILL every process of a mount's daemon (a lost node) and wait for them: those
    found dead by the time their turn comes went with the main one (parent-death
    signals: workers, the peer servers)."""
    for pid in daemon_pids_for(os.path.realpath(mount.path)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in mount.pids:
        kill_and_reap(pid)


def _run_quietly(cmd: list[str], timeout: float) -> str:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return result.stderr.strip()


def chunked_dataset(tmp_path: Path, files: int, seed: int):
    """A dataset of `files` random 250,000-byte files in 256 KiB chunks (about one file
    per chunk), populated in-process: for stager and chunk-cache tests."""
    import numpy as np

    from dlfs.store.populate import PopulateOptions, populate
    from dlfs.store.store import Store

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(files):
        (src / f"f{i}").write_bytes(rng.bytes(250_000))
    return populate(src, Store(tmp_path / "store"), "ds",
                    PopulateOptions(chunk_size=256 << 10, fsync=False, progress=False))


async def until(condition, timeout: float) -> bool:
    """Poll `condition` every 5 ms (trio) for up to `timeout` s; its last value."""
    import trio

    with trio.move_on_after(timeout):
        while not condition():
            await trio.sleep(0.005)
    return condition()


@contextlib.contextmanager
def tmpfs_at(path: Path, options: str):
    """A tmpfs mounted at `path` (made if missing) for the block, unmounted after even
    if the test fails: a small disk that fills, or a read-only one (even for root).
    Skips the test where tmpfs cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {made.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


@contextlib.contextmanager
def overlayfs_at(base: Path, prepare_lower=None):
    """An overlay file system (what a container's root and /tmp are) mounted at
    base/merged for the block, its layers in base/{lower,upper,work}; yields the merged
    directory. `prepare_lower(lower)` may fill the lower (image) layer first. Unmounted
    after the block even if the test fails, with any FUSE mount left inside it first.
    Where base is itself on an overlay (the suite run with TMPDIR there), which cannot
    hold an upper layer, the layers go on a tmpfs mounted for the block. Skips the
    test, saying why, where overlayfs cannot be mounted (not root, no module)."""
    with contextlib.ExitStack() as stack:
        if fstype_at_or_above(base) == "overlay":
            base = stack.enter_context(tmpfs_at(base / "layers", "size=1g"))
        layers = [base / name for name in ("lower", "upper", "work", "merged")]
        for layer in layers:
            layer.mkdir(parents=True, exist_ok=True)
        lower, upper, work, merged = layers
        if prepare_lower is not None:
            prepare_lower(lower)
        try:
            made = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                                   f"lowerdir={lower},upperdir={upper},workdir={work}",
                                   str(merged)], capture_output=True, text=True)
        except OSError as err:  # no mount(8)
            pytest.skip(f"cannot mount an overlay file system here: {err}")
        if made.returncode != 0:
            pytest.skip(f"cannot mount an overlay file system here: "
                        f"{made.stderr.strip() or made.returncode}")
        stack.callback(_unmount_overlay, merged)
        yield merged


def fstype_at_or_above(path: Path) -> str | None:
    """The type of the file system `path` is on (its mount, or the nearest above)."""
    found = mounts_by_path()
    path = Path(os.path.realpath(path))
    for candidate in (path, *path.parents):
        if str(candidate) in found:
            return found[str(candidate)]
    return None


def _unmount_overlay(merged: Path) -> None:
    """Teardown: FUSE mounts left inside first (a failed test's), then the overlay;
    lazily if something still holds it. Never raises."""
    inside = [mp for mp in mounts_by_path() if mp.startswith(str(merged) + "/")]
    for mp in sorted(inside, reverse=True):
        force_unmount(Path(mp))
    if subprocess.run(["umount", str(merged)], capture_output=True).returncode != 0:
        _run_quietly(["umount", "-l", str(merged)], 30)


def force_unmount(mountpoint: Path) -> list[str]:
    """Unmount however possible and kill its daemon; returns what had to be forced.

    Never raises: it runs in teardown, also after a failed test.
    """
    forced = []
    pids = daemon_pids_for(mountpoint)
    if fstype_at(mountpoint) is not None:
        message = _run_quietly([*DLFS, "umount", str(mountpoint), "--timeout", "10"], 60)
        if fstype_at(mountpoint) is not None:
            forced.append(f"dlfs umount failed: {message}")
            _run_quietly(["fusermount3", "-u", "-z", str(mountpoint)], 30)
        if fstype_at(mountpoint) is not None:
            _run_quietly(["umount", "-l", str(mountpoint)], 30)
    for pid in pids + daemon_pids_for(mountpoint):
        if pid_alive(pid):
            forced.append(f"killed daemon {pid}")
            kill_and_reap(pid)
    return forced


@dataclass
class Mount:
    """A live background mount made by `dlfs mount`."""

    path: Path
    store: Path
    log: Path
    pid: int  # the main daemon process
    pids: list[int]  # all daemon processes (main and forked workers) right after mounting

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __truediv__(self, other: str | bytes) -> Path | bytes:
        if isinstance(other, bytes):
            return os.path.join(os.fsencode(self.path), other)
        return self.path / other

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class Mounter:
    """Makes background mounts under `base` and tears all of them down."""

    base: Path
    mountpoints: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.base = self.base.resolve()  # the daemon records the real path

    def new_mountpoint(self) -> Path:
        mp = self._unique(self.base / "mnt")
        mp.mkdir(parents=True)
        return mp

    def adopt(self, mountpoint: Path) -> Path:
        """Take on a mountpoint that another `dlfs` (not this checkout's) mounts:
        teardown unmounts it and kills its daemon like one of ours."""
        if mountpoint not in self.mountpoints:
            self.mountpoints.append(mountpoint)
        _ACTIVE_MOUNTPOINTS.add(str(mountpoint))
        return mountpoint

    def _unique(self, stem: Path) -> Path:
        i = 0
        while True:
            candidate = stem.with_name(f"{stem.name}{i}")
            if not candidate.exists():
                return candidate
            i += 1

    def try_mount(self, store: Path, *args: str, mountpoint: Path | None = None,
                  log: Path | None = None, env: dict | None = None
                  ) -> subprocess.CompletedProcess:
        require_fuse()
        mp = mountpoint or self.new_mountpoint()
        if mp not in self.mountpoints:
            self.mountpoints.append(mp)  # before mounting: teardown also cleans a half mount
        _ACTIVE_MOUNTPOINTS.add(str(mp))
        log = log or mp.with_name(mp.name + ".dlfsd.log")
        return run_dlfs("mount", mp, "--store", store, "--log-file", log, "--timeout", "60",
                        *args, env=env, timeout=120)

    def __call__(self, store: Path, *args: str, mountpoint: Path | None = None) -> Mount:
        mp = mountpoint or self.new_mountpoint()
        log = mp.with_name(mp.name + ".dlfsd.log")
        result = self.try_mount(store, *args, mountpoint=mp, log=log)
        if result.returncode != 0:
            pytest.fail("mount failed: " + describe_result(result) + "\n--- daemon log ---\n"
                        + (log.read_text(errors="replace") if log.exists() else ""))
        real = os.path.realpath(mp)  # what the daemon records
        main = main_daemon_pids(real)
        assert len(main) == 1, f"expected one main dlfsd for {real}, found {main}"
        assert fstype_at(real) == "fuse.dlfs", f"{real} is not a fuse.dlfs mount after dlfs mount"
        return Mount(path=mp, store=store, log=log, pid=main[0], pids=daemon_pids_for(real))

    def cleanup(self) -> list[str]:
        forced = []
        for mp in reversed(self.mountpoints):
            forced += force_unmount(mp)
            _ACTIVE_MOUNTPOINTS.discard(str(mp))
        self.mountpoints.clear()
        return forced


# -- fixtures -------------------------------------------------------------------
# Tests that make real FUSE mounts or start daemons (directly, through mpirun or
# Slurm) carry the `mount` marker: `pytest -m "not mount"` is the fast unit subset.
MOUNT_FIXTURES = {"mounted", "make_mounter", "daemon_guard"}
MOUNT_MODULES = {"test_mpi", "test_slurm", "test_prefetch", "test_staging_durability",
                 "test_trace_cli"}


def pytest_configure(config):
    config.addinivalue_line("markers", "mount: makes real FUSE mounts or starts daemons "
                                       "(deselect with -m 'not mount')")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (MOUNT_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                or item.module.__name__ in MOUNT_MODULES):
            item.add_marker(pytest.mark.mount)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """pytest-trio (0.8) re-raises a skip from inside a trio test without its reason
    (`pytest.skip()` in its exception-group handling), so `-rs` said only "Skipped":
    raise the test's own skip instead, reason and place, so that a test skipped where
    this machine lacks a feature (tests/pagecache.py) says which."""
    try:
        return (yield)
    except pytest.skip.Exception as skipped:
        group = skipped.__context__  # the exception group it was raised handling
        if skipped.msg or not hasattr(group, "exceptions"):
            raise
        leaves, queue = [], [group]
        while queue:
            ex = queue.pop()
            if hasattr(ex, "exceptions"):  # a (Base)ExceptionGroup (Python < 3.11 too)
                queue.extend(ex.exceptions)
            else:
                leaves.append(ex)
        if len(leaves) == 1 and isinstance(leaves[0], pytest.skip.Exception):
            raise leaves[0] from None
        raise


@pytest.fixture(scope="session")
def dlfs_cli():
    return run_dlfs


@pytest.fixture(scope="session")
def sysproc():
    """Process and mount helpers that read /proc directly (not through dlfs code)."""
    return SimpleNamespace(dlfs_argv=DLFS, fstype_at=fstype_at, pid_alive=pid_alive,
                           wait_dead=wait_dead, kill_and_reap=kill_and_reap,
                           daemon_pids_for=daemon_pids_for, dlfsd_processes=dlfsd_processes)


@pytest.fixture(scope="session")
def edge_tree(tmp_path_factory) -> EdgeTree:
    return make_edge_tree(tmp_path_factory.mktemp("edge") / "src", TEST_CHUNK_SIZE)


@pytest.fixture(scope="session")
def edge_nodes(edge_tree):
    return describe_tree(edge_tree.root)


@pytest.fixture(scope="session")
def edge_store(tmp_path_factory, edge_tree) -> Path:
    return populate_store(edge_tree, tmp_path_factory.mktemp("edge-store") / "store", "edge")


@pytest.fixture(scope="session")
def store_with(tmp_path_factory):
    def factory(tree: Path | EdgeTree, name: str = "ds", chunk_size: str | int = "256K",
                store: Path | None = None, *extra: str) -> Path:
        store = store or tmp_path_factory.mktemp("store") / "store"
        return populate_store(tree, store, name, chunk_size, *extra)

    return factory


@pytest.fixture
def mounted(tmp_path_factory):
    mounter = Mounter(tmp_path_factory.mktemp("mounts"))
    yield mounter
    mounter.cleanup()


@pytest.fixture(scope="session")
def make_mounter(tmp_path_factory):
    """For module-scoped mounts: `m = make_mounter(); ...; m.cleanup()`."""
    return lambda: Mounter(tmp_path_factory.mktemp("mounts"))


@pytest.fixture
def daemon_guard(tmp_path_factory):
    base = tmp_path_factory.getbasetemp().resolve()
    yield
    left = {pid: mp for pid, mp in daemons_under(base).items()
            if mp not in _ACTIVE_MOUNTPOINTS}
    stale = [mp for mp, fstype in mounts_by_path().items()
             if mp.startswith(str(base) + "/") and fstype.startswith("fuse")
             and mp not in _ACTIVE_MOUNTPOINTS]
    for mp in stale:
        force_unmount(Path(mp))
    for pid in left:
        kill_and_reap(pid)
    assert not left, f"dlfsd processes left running after the test: {left}"
    assert not stale, f"FUSE mounts left after the test: {stale}"

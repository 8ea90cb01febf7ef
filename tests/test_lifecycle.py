"""Process lifecycle: populate killed or interrupted, daemons killed, stale and double mounts.

Real processes and real signals: `dlfs populate` is killed once its temporary
directory exists (SIGKILL) or once it writes chunks (SIGTERM/SIGINT); daemons
are killed with SIGKILL and their mounts cleaned with the real `dlfs umount` /
`dlfs mount`. After every test no `dlfsd` of this session may be left running
(daemon_guard).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trees import describe_tree, make_small_tree, regular_files, sha256_file

from dlfs.errors import DlfsError
from dlfs.runtime import (
    control_socket_path,
    lock_path,
    read_record,
    record_path,
    status_path,
    write_record,
)
from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Store

pytestmark = pytest.mark.usefixtures("daemon_guard")

SPARSE_FILES = 8
SPARSE_SIZE = 64 << 20  # 512 MiB in all: populate needs seconds, the source needs no disk


@pytest.fixture(scope="module")
def sparse_source(tmp_path_factory) -> Path:
    """A source big enough that populate is still writing when we signal it."""
    root = tmp_path_factory.mktemp("sparse") / "src"
    root.mkdir()
    for i in range(SPARSE_FILES):
        with open(root / f"volume_{i}.bin", "wb") as f:
            f.truncate(SPARSE_SIZE)
    make_small_tree(root / "small", files=10)
    return root


@pytest.fixture(scope="module")
def small_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("small") / "src"
    make_small_tree(root, files=30, seed=5)
    return root


@pytest.fixture
def small_store(small_source, store_with) -> Path:
    return store_with(small_source, "ds")


def temp_dirs(store: Path, name: str) -> list[str]:
    return sorted(n for n in os.listdir(store) if n.startswith(f".tmp-{name}.")) \
        if store.exists() else []


@pytest.fixture
def start_populate(sysproc):
    """start_populate(source, store, name) -> Popen, once its temporary directory exists.

    Any populate still running at teardown is killed.
    """
    procs: list[subprocess.Popen] = []

    def start(source: Path, store: Path, name: str) -> subprocess.Popen:
        proc = subprocess.Popen([*sysproc.dlfs_argv, "populate", str(source), "--store",
                                 str(store), "--name", name, "--chunk-size", "64M"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        deadline = time.monotonic() + 60
        while not temp_dirs(store, name):
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"populate exited {proc.returncode} before writing: {out}{err}")
            assert time.monotonic() < deadline, "no temporary directory within 60 s"
            time.sleep(0.002)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            sysproc.kill_and_reap(proc.pid)
        proc.communicate()


def has_chunk_file(store: Path, name: str) -> bool:
    for tmp in temp_dirs(store, name):
        try:
            if os.listdir(store / tmp / "chunks"):
                return True
        except FileNotFoundError:
            pass
    return False


def wait_for_first_chunk(store: Path, name: str, proc: subprocess.Popen) -> None:
    """Until a chunk file exists: populate is then inside its write-and-clean-up block."""
    deadline = time.monotonic() + 60
    while not has_chunk_file(store, name):
        assert proc.poll() is None, "populate exited before writing a chunk"
        assert time.monotonic() < deadline, "populate wrote no chunk within 60 s"
        time.sleep(0.002)


def kill_populate_midway(start_populate, source: Path, store: Path, name: str) -> None:
    proc = start_populate(source, store, name)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert temp_dirs(store, name), "populate finished before the kill: make the source bigger"


def assert_read_back(mountpoint: Path, dataset: str, source: Path) -> None:
    expected = describe_tree(source)
    root = os.path.join(os.fsencode(mountpoint), dataset.encode())
    files = regular_files(expected)
    assert files
    wrong = [rel for rel in files
             if sha256_file(os.path.join(root, rel)) != expected[rel].sha256]
    assert wrong == []


@pytest.fixture
def kill_daemon(sysproc):
    def kill(pids: list[int]) -> None:
        """SIGKILL every process of a daemon (main and workers), as a crash or OOM kill would."""
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            assert sysproc.wait_dead(pid), f"daemon process {pid} survived SIGKILL"

    return kill


def leave_nothing_at(sysproc, mountpoint: Path,
                     proc: subprocess.Popen | None = None) -> None:
    """Teardown of a test that starts processes itself: kill `proc` and any daemon of
    `mountpoint` still running, lazily unmount it."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.communicate()
    for pid in sysproc.daemon_pids_for(mountpoint):
        sysproc.kill_and_reap(pid)
    subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)


# -- populate ------------------------------------------------------------------------
def test_sigkilled_populate_publishes_nothing(dlfs_cli, sparse_source, tmp_path,
                                             start_populate):
    store = tmp_path / "store"
    kill_populate_midway(start_populate, sparse_source, store, "big")
    assert not (store / "big").exists()
    assert Store(store).dataset_names() == []
    listing = dlfs_cli("ls", "--store", store)
    assert listing.returncode == 0
    assert "big" not in listing.stdout


def test_populate_after_sigkill_succeeds_and_cleans_leftover(dlfs_cli, sparse_source,
                                                             small_source, tmp_path,
                                                             start_populate):
    store = tmp_path / "store"
    kill_populate_midway(start_populate, sparse_source, store, "big")
    result = dlfs_cli("populate", small_source, "--store", store, "--name", "big")
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(store)) == ["big"], "the killed run's leftover must be cleaned"
    assert Store(store).dataset_names() == ["big"]
    assert dlfs_cli("verify", "--store", store, "big").returncode == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_interrupted_populate_removes_its_temp_dir(sparse_source, tmp_path, signum,
                                                   start_populate):
    store = tmp_path / "store"
    proc = start_populate(sparse_source, store, "big")
    wait_for_first_chunk(store, "big", proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert len(stderr.splitlines()) == 1 and "interrupted" in stderr, stderr
    assert os.listdir(store) == [], "nothing published and no temporary directory left"


def test_interrupt_right_after_temp_dir_is_made_leaves_nothing(monkeypatch, small_source,
                                                               tmp_path):
    """In-process: KeyboardInterrupt (what `dlfs` turns SIGINT/SIGTERM into) raised at the
    first moment the temporary directory is complete, the window a real signal can hit."""
    store = tmp_path / "store"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if self.parent.name.startswith(".tmp-"):
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(KeyboardInterrupt):
        populate(small_source, Store(store), "x", PopulateOptions(chunk_size=256 << 10,
                                                                    fsync=False))
    monkeypatch.undo()
    assert os.listdir(store) == []


# -- populate --force: the name is never left empty -----------------------------------
def _other_source(tmp_path: Path) -> Path:
    other = tmp_path / "other"
    make_small_tree(other, files=7, seed=9, prefix="o")
    return other


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_force_puts_the_old_dataset_back_if_the_new_one_cannot_take_its_place(
        monkeypatch, small_store, tmp_path):
    before = Store(small_store).open("ds").uuid
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if Path(src).name.startswith(".tmp-"):  # the second rename: the new one in place
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(DlfsError, match="nothing was published"):
        populate(_other_source(tmp_path), Store(small_store), "ds",
                 PopulateOptions(chunk_size=256 << 10, fsync=False, force=True))
    monkeypatch.undo()
    assert Store(small_store).open("ds").uuid == before
    assert os.listdir(small_store) == ["ds"], "nothing moved aside or half-written is left"


def test_force_holds_ctrl_c_until_the_new_dataset_took_the_name(monkeypatch, small_store,
                                                                tmp_path):
    """SIGINT between the two renames (old aside, new in place) is acted on only after
    them: the name is never empty, and the message says the new dataset was published."""
    before = Store(small_store).open("ds").uuid
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        result = real_rename(src, dst, *args, **kwargs)
        if Path(dst).name.startswith(".old-"):  # after the first rename
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # a handler that was not held would run now
            assert not (small_store / "ds").exists()
        return result

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt, match="dataset 'ds' was published"):
        populate(_other_source(tmp_path), Store(small_store), "ds",
                 PopulateOptions(chunk_size=256 << 10, fsync=False, force=True))
    monkeypatch.undo()
    assert Store(small_store).open("ds").uuid != before
    assert sorted(os.listdir(small_store)) == ["ds"], "the replaced dataset is deleted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_dataset_moved_aside_by_a_killed_force_populate_is_put_back(dlfs_cli, small_store,
                                                                      tmp_path):
    """Killed between the two renames (SIGKILL cannot be held): the next populate of the
    name puts the old dataset back instead of deleting it as a leftover."""
    before = Store(small_store).open("ds").uuid
    host = socket.gethostname().replace(".", "_")
    (small_store / "ds").rename(small_store / f".old-ds.{host}.{_dead_pid()}.abcd1234")
    result = dlfs_cli("populate", _other_source(tmp_path), "--store", small_store,
                      "--name", "ds")
    assert result.returncode == 1 and "already exists" in result.stderr, result.stderr
    assert "put dataset 'ds' back" in result.stderr
    assert os.listdir(small_store) == ["ds"]
    assert Store(small_store).open("ds").uuid == before
    assert dlfs_cli("verify", "--store", small_store, "ds").returncode == 0


def test_partial_leftovers_are_removed_not_put_back(dlfs_cli, small_store, small_source,
                                                    tmp_path):
    """A moved-aside dataset missing a chunk, or one a killed `dlfs rm` was deleting, is
    never resurrected."""
    host = socket.gethostname().replace(".", "_")
    broken = small_store / f".old-ds.{host}.{_dead_pid()}.abcd1234"
    (small_store / "ds").rename(broken)
    next((broken / "chunks").iterdir()).unlink()
    shutil.copytree(broken, small_store / f".rm-ds.{host}.{_dead_pid()}.abcd1234")
    result = dlfs_cli("populate", small_source, "--store", small_store, "--name", "ds")
    assert result.returncode == 0, result.stderr
    assert os.listdir(small_store) == ["ds"]
    assert dlfs_cli("verify", "--store", small_store, "ds").returncode == 0


# -- daemon killed -------------------------------------------------------------------
def test_mountpoint_that_is_not_utf8_mounts_and_unmounts(dlfs_cli, mounted, small_store,
                                                         small_source, tmp_path):
    mountpoint = Path(os.fsdecode(bytes(tmp_path) + b"/mnt\xff"))
    mountpoint.mkdir()
    m = mounted(small_store, mountpoint=mountpoint)
    assert_read_back(m.path, "ds", small_source)
    result = dlfs_cli("umount", m.path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert os.listdir(mountpoint) == []


def _waiting_on_dev_fuse(pid: int) -> bool:
    """Blocked in readv/read of a /dev/fuse descriptor: an idle worker."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
        if fields[0] not in ("0", "19"):  # read, readv
            return False
        return os.readlink(f"/proc/{pid}/fd/{int(fields[1], 16)}") == "/dev/fuse"
    except (OSError, IndexError, ValueError):
        return False


def _abort_fuse_connection(mountpoint: Path) -> None:
    """The last resort that unsticks readers of a hung FUSE mount (fusectl's abort)."""
    conns = Path("/sys/fs/fuse/connections")
    if not any(conns.iterdir()):
        subprocess.run(["mount", "-t", "fusectl", "none", str(conns)], check=False)
    minor = os.minor(os.lstat(mountpoint.parent / mountpoint.name).st_dev)
    with contextlib.suppress(OSError):
        (conns / str(minor) / "abort").write_text("1")


def test_a_worker_killed_mid_request_does_not_hang_its_reader(mounted, tmp_path, store_with):
    """SIGKILL (an OOM kill) of the worker serving a read: the read is answered by another
    worker (its request goes back to the kernel's queue), and the mount serves on."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(2 << 20)
    (src / "big").write_bytes(data)
    store = store_with(src, "ds", "64M", tmp_path / "store")
    # A slow store (1 MiB/s) keeps the worker busy with the read for about a second.
    m = mounted(store, "--workers", "2", "--store-bandwidth", "1M", "--prefetch", "off")
    deadline = time.monotonic() + 10  # the workers are forked just before READY
    while len(idle := [pid for pid in m.pids if _waiting_on_dev_fuse(pid)]) < 2:
        assert time.monotonic() < deadline, f"both workers wait for requests: {idle}"
        time.sleep(0.01)
    reader = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        f"fd = os.open({str(m / 'ds' / 'big')!r}, os.O_RDONLY)\n"
        "sys.stdout.buffer.write(os.pread(fd, 1 << 20, 0))")], stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        busy = []
        while not busy:
            assert time.monotonic() < deadline, "no worker took the read"
            busy = [pid for pid in idle if not _waiting_on_dev_fuse(pid)]
            time.sleep(0.01)
        os.kill(busy[0], signal.SIGKILL)
        try:
            out, _ = reader.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _abort_fuse_connection(m.path)
            reader.communicate(timeout=30)
            pytest.fail("the read held by the killed worker never got an answer")
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()
    assert reader.returncode == 0
    assert out == data[: 1 << 20]
    assert (m / "ds" / "big").read_bytes() == data  # the other worker serves on
    log = m.log_text()
    assert f"worker process {busy[0]} died (killed by SIGKILL)" in log, log
    assert "went back to the queue" in log, log


def test_umount_of_a_killed_daemon_does_not_signal_a_process_that_reused_its_pid(
        dlfs_cli, mounted, small_store, kill_daemon):
    """After a SIGKILL the record stays; its pid may belong to another process by then."""
    m = mounted(small_store)
    kill_daemon(m.pids)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        record = read_record(str(m.path))
        record.pid = bystander.pid  # as if the kernel had handed the pid out again
        write_record(record)
        started = time.monotonic()
        result = dlfs_cli("umount", m.path)
        assert result.returncode == 0, result.stderr
        assert bystander.poll() is None, "umount signalled a process that is not the daemon"
        assert time.monotonic() - started < 10, "umount waited for the other process"
    finally:
        bystander.kill()
        bystander.wait()


def test_mount_refuses_a_live_mount_whose_record_is_gone(dlfs_cli, mounted, small_store):
    """logind removes /run/user/UID at logout; a record may be in another runtime dir.
    The live mount must stay (it used to be detached as if its daemon were dead)."""
    m = mounted(small_store)
    record_path(str(m.path)).unlink()
    result = dlfs_cli("mount", m.path, "--store", small_store)
    assert result.returncode == 1 and "already mounted" in result.stderr, result.stderr
    assert os.listdir(m / "ds")  # still served


def test_mount_and_umount_agree_on_a_path_through_a_symlink_and_dotdot(
        dlfs_cli, mounted, small_store, tmp_path, sysproc):
    (tmp_path / "y" / "z").mkdir(parents=True)
    (tmp_path / "y" / "mnt").mkdir()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "link").symlink_to("../y/z")
    via = tmp_path / "x" / "link" / ".." / "mnt"  # the kernel goes to y/mnt
    mounted(small_store, mountpoint=via)
    assert sysproc.fstype_at(tmp_path / "y" / "mnt") == "fuse.dlfs"
    result = dlfs_cli("umount", via)
    assert result.returncode == 0, result.stderr
    assert sysproc.fstype_at(tmp_path / "y" / "mnt") is None


def test_interrupted_mount_leaves_no_daemon_and_no_mount(sysproc, small_store, tmp_path):
    """Ctrl-C on `dlfs mount` while its daemon starts: the daemon (its own session) is
    stopped, with anything it forked, and a mount it made is taken away."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = subprocess.Popen([*sysproc.dlfs_argv, "mount", str(mp), "--store",
                             str(small_store)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not sysproc.daemon_pids_for(mp):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no daemon started"
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        time.sleep(2)  # a daemon left running would have mounted by now
        assert sysproc.daemon_pids_for(mp) == []
        assert sysproc.fstype_at(mp) is None
    finally:
        leave_nothing_at(sysproc, mp, proc)


def test_interrupt_as_the_daemon_starts_still_stops_it(monkeypatch, sysproc, small_store,
                                                       tmp_path):
    """Ctrl-C that lands inside Popen, after the daemon was started but before `dlfs
    mount` holds its pid (the window the test above hits 1 run in 50): the daemon is
    stopped all the same. Before, the interrupt left the try that cleans up, and the
    daemon went on to mount with nobody to stop it."""
    def ctrl_c(proc: subprocess.Popen) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # as if it came during Popen's last steps

    mp = tmp_path / "mnt"
    try:
        mount_interrupted(monkeypatch, small_store, mp, ctrl_c)
        time.sleep(2)  # a daemon left running would have mounted by now
        assert sysproc.daemon_pids_for(mp) == []
        assert sysproc.fstype_at(mp) is None
    finally:
        leave_nothing_at(sysproc, mp)


def mount_interrupted(monkeypatch, store: Path, mountpoint: Path, after_spawn) -> None:
    """mountctl.mount in the background, with `after_spawn(proc)` run right after the
    daemon is spawned (inside Popen, as far as `dlfs mount` can tell); it must end in
    KeyboardInterrupt."""
    import dlfs.cli.mountctl as mountctl
    from dlfs.config import MountConfig

    real_spawn = mountctl._spawn_daemon

    def spawn(*args):
        proc = real_spawn(*args)
        after_spawn(proc)
        return proc

    monkeypatch.setattr(mountctl, "_spawn_daemon", spawn)
    mountpoint.mkdir()
    config = MountConfig(mountpoint=str(mountpoint), store=str(store),
                         log_file=str(mountpoint.with_name("dlfsd.log")))
    with pytest.raises(KeyboardInterrupt):
        mountctl.mount(config, foreground=False)


def run_mount_script(script: str, mountpoint: Path, store: Path,
                     log: Path) -> subprocess.CompletedProcess:
    """`python -c SCRIPT MOUNTPOINT STORE LOG` (the mountpoint made first)."""
    mountpoint.mkdir()
    return subprocess.run([sys.executable, "-c", script, str(mountpoint), str(store),
                           str(log)], capture_output=True, text=True, timeout=60)


# `dlfs mount --foreground` with a Ctrl-C that lands right after the mount(2) is made.
CTRL_C_AFTER_INIT = """
import os, signal, sys
from dlfs.cli.main import main
from dlfsd.fuse.rawsession import RawSession
real_mount = RawSession.mount
def mount_then_ctrl_c(self):
    real_mount(self)
    os.kill(os.getpid(), signal.SIGINT)
RawSession.mount = mount_then_ctrl_c
sys.exit(main(["mount", sys.argv[1], "--store", sys.argv[2], "--foreground",
               "--log-file", sys.argv[3]]))
"""


def test_ctrl_c_right_after_a_foreground_mount_is_made_unmounts_it(sysproc, small_store,
                                                                     tmp_path):
    """Before, the KeyboardInterrupt left run() before the try that unmounts: the
    process exited and left a dead mount (ENOTCONN) behind."""
    mp, log = tmp_path / "mnt", tmp_path / "dlfsd.log"
    try:
        done = run_mount_script(CTRL_C_AFTER_INIT, mp, small_store, log)
        assert done.returncode == 0, done.stderr
        assert sysproc.fstype_at(mp) is None, "a dead mount was left behind"
        assert "got SIGINT; unmounting" in log.read_text()
    finally:
        subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True)


# The daemon fails right after forking its workers (the peer port taken meanwhile),
# while the workers are still starting (slowed down here: a loaded node).
FAIL_AFTER_FORK = """
import sys, time
import dlfsd.main as daemon
import dlfsd.fuse.wireworker as wireworker
import dlfsd.services as services
from dlfs.config import MountConfig
from dlfs.errors import DlfsError
real_init = wireworker.WireWorker.__init__
def slow_init(self, *args, **kwargs):
    time.sleep(0.5)
    real_init(self, *args, **kwargs)
wireworker.WireWorker.__init__ = slow_init
def port_taken(self, *args):
    raise DlfsError("cannot listen for peers: port taken (simulated)")
services.Services.listen = port_taken
started = time.monotonic()
code = daemon.run(MountConfig(mountpoint=sys.argv[1], store=sys.argv[2], workers=4,
                              log_file=sys.argv[3]))
print(code, round(time.monotonic() - started, 2))
"""


def test_workers_stopped_as_they_start_do_not_wait_for_sigkill(sysproc, small_store, tmp_path):
    """A stop signal sent to a worker before it has its own handlers used to meet the
    handler inherited from the main process, which only records signals for the main
    process: the worker served on until stop_workers gave up and SIGKILLed it, 10 s."""
    mp, log = tmp_path / "mnt", tmp_path / "dlfsd.log"
    try:
        done = run_mount_script(FAIL_AFTER_FORK, mp, small_store, log)
        code, seconds = done.stdout.split()
        assert code != "0", done.stdout + done.stderr
        assert float(seconds) < 5, f"stopping the workers took {seconds} s: {log.read_text()}"
        assert sysproc.fstype_at(mp) is None
    finally:
        subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True)


# A launcher that mounts, then dies: what `dlfs mount --mpi` ranks do when mpirun is
# interrupted while another rank still comes up (tests/test_mpi.py runs that for real).
LAUNCHER = """
import sys, time
from dlfs.config import MountConfig
from dlfs.cli.mountctl import mount_uncommitted
mount_uncommitted(MountConfig(mountpoint=sys.argv[1], store=sys.argv[2], log_file=sys.argv[3],
                              workers=int(sys.argv[4])))
print("mounted", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("workers", [1, 4])
def test_an_uncommitted_mount_goes_when_its_launcher_dies(sysproc, small_store, small_source,
                                                          tmp_path, workers):
    mp = tmp_path / "mnt"
    mp.mkdir()
    log = tmp_path / "dlfsd.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(mp), str(small_store),
                                 str(log), str(workers)], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout.readline() == "mounted\n"
        assert_read_back(mp, "ds", small_source)  # it serves meanwhile
        pids = sysproc.daemon_pids_for(mp)
        assert pids
        launcher.kill()
        launcher.wait()
        assert all(sysproc.wait_dead(pid, 20) for pid in pids), log.read_text()
        assert sysproc.fstype_at(mp) is None
        assert "before committing this mount; unmounting" in log.read_text()
    finally:
        leave_nothing_at(sysproc, mp, launcher)


def test_a_committed_mount_stays_once_the_pipe_is_closed(dlfs_cli, sysproc, small_store,
                                                         small_source, tmp_path):
    from dlfs.cli.mountctl import commit_mount, mount_uncommitted
    from dlfs.config import MountConfig

    mp = tmp_path / "mnt"
    mp.mkdir()
    log = tmp_path / "dlfsd.log"
    config = MountConfig(mountpoint=str(mp), store=str(small_store), log_file=str(log))
    fd = mount_uncommitted(config)
    try:
        commit_mount(fd, config)  # closes fd: as if the launcher had ended
        time.sleep(1)  # time enough for a daemon that took it for a failure to unmount
        assert sysproc.fstype_at(mp) == "fuse.dlfs", log.read_text()
        assert_read_back(mp, "ds", small_source)
        assert "before committing this mount" not in log.read_text()
        assert dlfs_cli("umount", mp).returncode == 0
    finally:
        leave_nothing_at(sysproc, mp)


def wait_until_sigterm_is_handled(pid: int, timeout: float = 20.0) -> None:
    bit = 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        masks = {}
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("SigBlk", "SigIgn", "SigCgt"):
                    masks[key] = int(value, 16)
        if any(m & bit for m in masks.values()):
            return
        time.sleep(0.001)
    raise AssertionError(f"daemon {pid} never took over SIGTERM")


def test_a_second_ctrl_c_does_not_cut_short_stopping_a_hung_daemon(monkeypatch, sysproc,
                                                                   small_store, tmp_path):
    """`dlfs mount` gives up on a daemon (Ctrl-C) that does not answer SIGTERM (stopped
    here, as a hung one would be), and an impatient user presses Ctrl-C again while it
    waits to send SIGKILL: before, that second one ended the wait, and the daemon was
    left behind for good."""
    import threading

    spawned: list[int] = []
    second: list[threading.Timer] = []
    fired = threading.Event()

    def second_ctrl_c() -> None:
        fired.set()
        os.kill(os.getpid(), signal.SIGINT)

    def hang_then_ctrl_c_twice(proc: subprocess.Popen) -> None:
        spawned.append(proc.pid)
        # A daemon still on SIGTERM's default action would be killed at once even while
        # stopped (the kernel makes a fatal signal kill a stopped process): hang it only
        # once it handles, blocks or ignores SIGTERM, as a daemon past its start does.
        wait_until_sigterm_is_handled(proc.pid)
        os.killpg(proc.pid, signal.SIGSTOP)  # hung: SIGTERM stays pending
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C (held until Popen is done)
        second.append(threading.Timer(1.0, second_ctrl_c))
        second[0].start()

    mp = tmp_path / "mnt"
    try:
        mount_interrupted(monkeypatch, small_store, mp, hang_then_ctrl_c_twice)
        assert fired.is_set(), "the mount gave up before the second Ctrl-C: nothing tested"
        assert spawned and not sysproc.pid_alive(spawned[0]), "the hung daemon was left"
        assert sysproc.fstype_at(mp) is None
    finally:
        for timer in second:  # never let a late Ctrl-C reach the next test
            timer.cancel()
        for pid in spawned:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        leave_nothing_at(sysproc, mp)


def test_two_mounts_of_one_path_at_once_make_one_mount(dlfs_cli, sysproc, small_store,
                                                        tmp_path):
    """`srun` with two tasks per node runs the prologue's mount twice at once."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    argv = [*sysproc.dlfs_argv, "mount", str(mp), "--store", str(small_store)]
    procs = [subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
        assert sorted(code for code, _ in results) == [0, 1], results
        error = next(err for code, err in results if code == 1)
        assert len(error.splitlines()) == 1 and error.startswith("dlfs: error:"), error
        assert "under way" in error or "already mounted" in error, error
        mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                  if line.split()[4] == str(mp)]
        assert len(mounts) == 1, mounts
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
        dlfs_cli("umount", mp)
        leave_nothing_at(sysproc, mp)


def test_killed_daemon_gives_enotconn(mounted, small_store, kill_daemon):
    m = mounted(small_store)
    os.listdir(m / "ds")  # works while the daemon lives
    kill_daemon(m.pids)
    with pytest.raises(OSError) as info:
        os.listdir(m.path)
    assert info.value.errno == errno.ENOTCONN
    with pytest.raises(OSError) as info:
        os.open(m / "ds/d1/f001.bin", os.O_RDONLY)
    assert info.value.errno == errno.ENOTCONN


def test_umount_cleans_a_dead_daemons_mount(dlfs_cli, mounted, small_store, kill_daemon, sysproc):
    m = mounted(small_store)
    key = str(m.path)
    assert control_socket_path(key).exists() and status_path(key).exists()
    kill_daemon(m.pids)
    result = dlfs_cli("umount", m.path)
    assert result.returncode == 0, result.stderr
    assert sysproc.fstype_at(m.path) is None
    assert os.listdir(m.path) == []  # the plain directory again
    left = [p for p in (record_path(key), control_socket_path(key), status_path(key))
            if p.exists()]
    assert left == [], "the killed daemon's runtime files must go with its mount"


def test_mount_and_umount_leave_no_runtime_files(dlfs_cli, small_store, tmp_path):
    """Before, every mountpoint ever mounted left its lock file behind (one per job on a
    node whose prolog mounts per-job paths)."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    key = str(mp)
    assert dlfs_cli("mount", mp, "--store", small_store).returncode == 0
    try:
        assert not lock_path(key).exists(), "the lock is only held while mounting"
        assert record_path(key).exists() and control_socket_path(key).exists()
    finally:
        assert dlfs_cli("umount", mp).returncode == 0
    left = [p for p in (lock_path(key), record_path(key), control_socket_path(key),
                        status_path(key)) if p.exists()]
    assert left == []


def test_remount_after_dead_daemon_reads_correctly(dlfs_cli, mounted, small_store, small_source,
                                                   kill_daemon):
    m = mounted(small_store)
    kill_daemon(m.pids)
    assert dlfs_cli("umount", m.path).returncode == 0
    again = mounted(small_store, mountpoint=m.path)
    assert_read_back(again.path, "ds", small_source)


def test_mount_over_stale_mount_works(mounted, small_store, small_source, kill_daemon):
    m = mounted(small_store)
    kill_daemon(m.pids)
    result = mounted.try_mount(small_store, mountpoint=m.path)
    assert result.returncode == 0, result.stderr
    assert_read_back(m.path, "ds", small_source)


def test_mount_over_stale_mount_works_without_attribute_cache(mounted, small_store, small_source,
                                                              kill_daemon):
    m = mounted(small_store, "--cache-timeout", "0")
    kill_daemon(m.pids)
    result = mounted.try_mount(small_store, mountpoint=m.path)
    assert result.returncode == 0, result.stderr
    assert_read_back(m.path, "ds", small_source)


_READ_ONE_FILE = """
import errno, sys
try:
    with open(sys.argv[1], "rb") as f:
        f.read()
except OSError as err:
    print(errno.errorcode.get(err.errno, err.errno))
else:
    print("read")
"""


def read_in_subprocess(path: Path, timeout: float = 60) -> str:
    """Read a whole file in a child process: "read", or the errno name it failed with.
    A read that hangs (a mount nobody answers) fails the test at `timeout` instead of
    hanging it; FUSE waits are killable, so the child is reaped."""
    try:
        done = subprocess.run([sys.executable, "-c", _READ_ONE_FILE, str(path)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a read of {path} hung for {timeout:.0f} s")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("workers", ["1", "4"])
def test_a_killed_main_process_takes_its_workers_and_the_mount_down(
        dlfs_cli, mounted, small_store, kill_daemon, sysproc, workers):
    """SIGKILL (an OOM kill) of the main daemon process: before, its forked workers
    served on with nobody supervising them (no resend for a worker that died, no status,
    no stager) until someone ran `dlfs umount`. Now they and the control process die
    with it (parent-death signal), the last /dev/fuse descriptor closes, the kernel
    aborts the connection, and readers get ENOTCONN; `dlfs status` and `dlfs umount`
    say the daemon died, and the umount cleans up after it."""
    m = mounted(small_store, "--workers", workers)
    children = [pid for pid in m.pids if pid != m.pid]
    # --workers FUSE processes (one for 1: the minimum) + the `dlfs trace` one
    assert len(children) == int(workers) + 1
    record = read_record(str(m.path))
    assert record is not None and record.pid == m.pid
    kill_daemon([m.pid])
    assert [pid for pid in children if not sysproc.wait_dead(pid, 10)] == [], \
        "worker or control processes outlived the main daemon process"
    # Never read before: no cached dentry or page can answer it without the daemon.
    assert read_in_subprocess(m / "ds/d1/f011.bin") == "ENOTCONN"
    assert sysproc.fstype_at(m.path) == "fuse.dlfs", "the dead mount stays until umount"

    status = dlfs_cli("status", m.path)
    assert status.returncode == 1 and status.stdout == ""
    assert f"the daemon of {m.path} (pid {m.pid}) is dead" in status.stderr, status.stderr
    assert "dlfs umount" in status.stderr and str(m.log) in status.stderr, status.stderr

    result = dlfs_cli("umount", m.path)
    assert result.returncode == 0, result.stderr
    said = result.stdout + result.stderr
    assert len(said.strip().splitlines()) == 1, said
    assert f"the daemon of {m.path} (pid {m.pid}) had died" in said, said
    assert str(m.log) in said, said
    assert sysproc.fstype_at(m.path) is None
    key = str(m.path)
    assert not any(p.exists() for p in (record_path(key), control_socket_path(key),
                                        status_path(key)))
    # Once unmounted there is nothing to report: the usual line.
    status = dlfs_cli("status", m.path)
    assert status.returncode == 1 and "no DLFS daemon serves" in status.stderr, status.stderr


def test_dead_worker_is_logged_and_the_others_keep_serving(mounted, small_store, small_source,
                                                           kill_daemon):
    m = mounted(small_store, "--workers", "3")
    victim = next(pid for pid in m.pids if pid != m.pid)
    kill_daemon([victim])
    for rel in regular_files(describe_tree(small_source))[:50]:  # answered by the survivors
        source = os.path.join(os.fsencode(small_source), rel)
        assert sha256_file(m / (b"ds/" + rel)) == sha256_file(source)
    deadline = time.monotonic() + 10
    while f"worker process {victim} died (killed by SIGKILL)" not in m.log_text():
        assert time.monotonic() < deadline, m.log_text()
        time.sleep(0.05)


def test_sigterm_to_daemon_unmounts(mounted, small_store, sysproc):
    m = mounted(small_store)
    os.kill(m.pid, signal.SIGTERM)
    assert all(sysproc.wait_dead(pid, 15) for pid in m.pids)
    assert sysproc.fstype_at(m.path) is None


def test_signals_repeated_during_shutdown_do_not_cut_it_short(mounted, small_store, sysproc):
    """An impatient scheduler or user sends TERM again and again: the first one starts
    the unmount, the others must not kill the daemon before it stopped its workers
    and unmounted (which left workers serving a mount nobody would take down)."""
    m = mounted(small_store, "--workers", "4")
    for _ in range(200):
        try:
            os.kill(m.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.001)
    assert all(sysproc.wait_dead(pid, 20) for pid in m.pids), "processes left running"
    assert sysproc.fstype_at(m.path) is None, "the mount was left behind"


# -- mount / umount contracts ----------------------------------------------------------
def test_mount_twice_is_one_line_error(mounted, small_store, small_source, sysproc):
    m = mounted(small_store)
    result = mounted.try_mount(small_store, mountpoint=m.path)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlfs: error:"), result.stderr
    assert str(m.path) in lines[0]
    assert all(sysproc.pid_alive(pid) for pid in m.pids), "the first daemon must keep serving"
    assert_read_back(m.path, "ds", small_source)


def test_umount_waits_until_the_daemon_is_gone(dlfs_cli, mounted, small_store, sysproc):
    m = mounted(small_store)
    os.listdir(m / "ds")
    result = dlfs_cli("umount", m.path)
    assert result.returncode == 0, result.stderr
    still = [pid for pid in m.pids if sysproc.pid_alive(pid)]  # checked at once: no grace period
    assert still == []
    assert sysproc.fstype_at(m.path) is None
    assert "daemon exits" in m.log_text()


def test_umount_of_busy_mount_is_one_line_error(dlfs_cli, mounted, small_store, small_source,
                                                sysproc):
    m = mounted(small_store)
    path = m / "ds/d0/f000.bin"
    fd = os.open(path, os.O_RDONLY)
    try:
        result = dlfs_cli("umount", m.path)
        assert result.returncode != 0
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("dlfs: error:"), result.stderr
        assert "busy" in lines[0]
        assert sysproc.fstype_at(m.path) == "fuse.dlfs"
        assert os.pread(fd, 1 << 20, 0) == (small_source / "d0/f000.bin").read_bytes()
    finally:
        os.close(fd)
    assert dlfs_cli("umount", m.path).returncode == 0
    assert not any(sysproc.pid_alive(pid) for pid in m.pids)


def test_lazy_umount_keeps_open_files_readable(dlfs_cli, mounted, small_store, small_source,
                                               sysproc):
    m = mounted(small_store)
    fd = os.open(m / "ds/d0/f002.bin", os.O_RDONLY)
    try:
        result = dlfs_cli("umount", "--lazy", "--timeout", "1", m.path)
        assert result.returncode == 0, result.stderr
        assert sysproc.fstype_at(m.path) is None  # detached at once
        assert os.pread(fd, 1 << 20, 0) == (small_source / "d0/f002.bin").read_bytes()
    finally:
        os.close(fd)
    assert all(sysproc.wait_dead(pid, 15) for pid in m.pids), "must exit once the file closes"


def test_a_detached_daemon_leaves_the_next_ones_socket_and_status_alone(
        dlfs_cli, mounted, small_store, sysproc):
    """umount --lazy, mount again at the same path, then the old daemon's last file
    closes and it exits: the new daemon's control socket and status file must stay."""
    old = mounted(small_store)
    fd = os.open(old / "ds/d0/f002.bin", os.O_RDONLY)
    try:
        assert dlfs_cli("umount", "--lazy", old.path).returncode == 0
        # Not through `mounted`: it tells daemons apart by mountpoint (its teardown
        # unmounts this one).
        result = dlfs_cli("mount", old.path, "--store", small_store)
        assert result.returncode == 0, result.stderr
        time.sleep(2.5)  # both daemons rewrite the status file meanwhile (every second)
    finally:
        os.close(fd)
    assert all(sysproc.wait_dead(pid, 15) for pid in old.pids), "the old daemon must exit"
    key = str(old.path)
    new_pid = read_record(key).pid
    assert new_pid not in old.pids
    assert control_socket_path(key).exists(), "the new daemon's control socket was removed"
    assert status_path(key).exists(), "the new daemon's status file was removed"
    time.sleep(1.5)
    assert json.loads(status_path(key).read_text())["pid"] == new_pid
    assert dlfs_cli("trace", "start", old.path).returncode == 0


def test_mountpoint_with_space_and_unicode(dlfs_cli, mounted, small_store, small_source,
                                           tmp_path, sysproc):
    mp = tmp_path / "mount point ü"
    mp.mkdir()
    m = mounted(small_store, mountpoint=mp)
    assert sysproc.fstype_at(mp) == "fuse.dlfs"
    assert_read_back(m.path, "ds", small_source)
    assert dlfs_cli("umount", mp).returncode == 0
    assert sysproc.fstype_at(mp) is None
    assert not any(sysproc.pid_alive(pid) for pid in m.pids)


def test_umount_through_the_symlink_used_to_mount(dlfs_cli, mounted, small_store, tmp_path,
                                                  sysproc):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    result = mounted.try_mount(small_store, mountpoint=link)
    mounted.mountpoints.append(real)  # teardown unmounts the real path whatever happens
    assert result.returncode == 0, result.stderr
    assert sysproc.fstype_at(real) == "fuse.dlfs"
    result = dlfs_cli("umount", link)
    assert result.returncode == 0, result.stderr
    assert sysproc.fstype_at(real) is None


@pytest.mark.parametrize("workers", ["1", "4"])
def test_an_aborted_connection_takes_the_mount_down(mounted, small_store, sysproc, workers):
    """fusectl abort (or umount -f): the daemon must not exit leaving a dead mount
    behind (ENOTCONN for every later access until someone unmounts by hand)."""
    m = mounted(small_store, "--workers", workers)
    _abort_fuse_connection(m.path)
    assert all(sysproc.wait_dead(pid, 20) for pid in m.pids), "the daemon must exit"
    assert sysproc.fstype_at(m.path) is None, "the aborted mount was left behind"

"""Shared helpers for the DLFS benchmark scripts (bench/*.py).

Everything here is plumbing: a work directory that is always removed, a
mount that is always unmounted, a cache drop, a table printer and the
ratio / target lines every script ends with. The scripts measure; they never
assert (a MISS is reported, not raised).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

_BIN = Path(sys.executable).parent
# The venv's `dlfs` if there is one, else the module (same code either way).
DLFS = [str(_BIN / "dlfs")] if (_BIN / "dlfs").exists() else [sys.executable, "-m", "dlfs.cli.main"]

_warned_cold = False
_main_pid = os.getpid()
_cleanup_depth = 0
_pending_interrupt = False


# -- process hygiene ---------------------------------------------------------
def _terminate(signum, frame):
    global _pending_interrupt
    if os.getpid() != _main_pid:
        # A forked reader (multiprocessing.Pool worker) inherited this handler:
        # die the default way, or Pool.terminate() can deadlock on it.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _cleanup_depth:
        # Never abandon an unmount or a removal half-way: finish it, then stop.
        _pending_interrupt = True
        print("interrupted: finishing cleanup first", file=sys.stderr)
        return
    raise KeyboardInterrupt


def install_signal_handlers() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt in this process (never during cleanup),
    so the `finally` clauses unmount and remove the work directory."""
    global _main_pid
    _main_pid = os.getpid()
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)


def run_main(main: Callable[[], int]) -> None:
    """Exit with main()'s code; 130 (no traceback) when interrupted."""
    install_signal_handlers()
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted; cleaned up", file=sys.stderr)
        code = 130
    sys.exit(code)


@contextlib.contextmanager
def _cleanup() -> Iterator[None]:
    """Defer SIGTERM/SIGINT until the block is done, then raise KeyboardInterrupt."""
    global _cleanup_depth, _pending_interrupt
    _cleanup_depth += 1
    try:
        yield
    finally:
        _cleanup_depth -= 1
        if _cleanup_depth == 0 and _pending_interrupt:
            _pending_interrupt = False
            raise KeyboardInterrupt


# -- arguments ---------------------------------------------------------------
def add_common_args(parser: argparse.ArgumentParser, rounds: int = 3) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="shrink every size ~20x (smoke run; figures are not meaningful)")
    parser.add_argument("--rounds", type=int, default=rounds,
                        help=f"alternating rounds per measurement; the median is reported "
                             f"(default {rounds})")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="parent directory for the work files (default: a fresh "
                             "directory made with tempfile.mkdtemp under /var/tmp)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (source trees, store) at the end")


def size_arg(text: str) -> int:
    """argparse type for sizes like 146M, 1G, 4096."""
    from dlfs.sizes import parse_size

    try:
        return parse_size(text)
    except Exception as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def formatter() -> type[argparse.HelpFormatter]:
    return argparse.RawDescriptionHelpFormatter


def split_args(text: str | None) -> list[str]:
    return shlex.split(text) if text else []


# -- work directory ----------------------------------------------------------
@contextlib.contextmanager
def workdir(parent: Path | None, keep: bool, prefix: str) -> Iterator[Path]:
    """A fresh directory (under `parent`, default /var/tmp), removed at the end unless keep."""
    base = parent or Path("/var/tmp")
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"dlfs-bench-{prefix}-", dir=base))
    print(f"work directory: {path}")
    try:
        yield path
    finally:
        with _cleanup():
            if keep:
                print(f"kept work directory: {path}")
            elif mounts_under(path):
                print(f"WARNING: not removing {path}: still mounted: {mounts_under(path)}",
                      file=sys.stderr)
            else:
                shutil.rmtree(path, ignore_errors=True)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` (from /proc/self/mounts)."""
    prefix = os.path.realpath(path)
    found = []
    # Another user's mount point may name itself in bytes that are not UTF-8.
    with open("/proc/self/mounts", errors="surrogateescape") as f:
        for line in f:
            target = line.split()[1].replace("\\040", " ")
            if target == prefix or target.startswith(prefix + "/"):
                found.append(target)
    return found


# -- dlfs commands -------------------------------------------------------------
def run_dlfs(args: Sequence[str], check: bool = True,
             pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """`dlfs ARGS`; `pythonpath`: run another checkout's code (a tree holding its `dlfs`
    and `dlfsd` packages, e.g. `git archive` of a commit with dlfsd -> daemon), which
    the daemon it starts inherits; from / (`python -m dlfsd` looks in its working
    directory first, where this checkout's `dlfs` may be). Paths must be absolute."""
    env, cwd = None, None
    if pythonpath:
        env, cwd = dict(os.environ, PYTHONPATH=pythonpath), "/"
    result = subprocess.run([*DLFS, *args], capture_output=True, text=True, env=env, cwd=cwd)
    if check and result.returncode != 0:
        raise RuntimeError(f"`dlfs {shlex.join(args)}` failed ({result.returncode}): "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def populate(source: Path, store: Path, name: str, extra: Sequence[str] = ()) -> float:
    """`dlfs populate`; returns the wall time of the whole command in seconds."""
    started = time.perf_counter()
    run_dlfs(["populate", str(source), "--store", str(store), "--name", name, *extra])
    return time.perf_counter() - started


def _daemon_pid(mountpoint: Path) -> int | None:
    try:
        from dlfs.runtime import read_record
    except ImportError:
        return None
    record = read_record(str(mountpoint))
    return record.pid if record else None


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the command name (state is [0], ppid [1])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


def _is_dlfsd(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dlfsd" in f.read()
    except OSError:
        return False


def _daemon_pids(main_pid: int) -> list[int]:
    """The daemon's main process and every process under it running dlfsd (its workers,
    and the peer servers its supervisor process forked)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields:
                parents[int(entry)] = int(fields[1])
    pids, todo = [], [main_pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += [child for child, parent in parents.items()
                 if parent == pid and _is_dlfsd(child)]
    return pids


def daemon_cpu_seconds(mountpoint: Path) -> float:
    """CPU time (user + system, all threads) the mount's daemon processes have used."""
    pid = _daemon_pid(mountpoint)
    total = 0
    for p in _daemon_pids(pid) if pid else []:
        fields = _stat_fields(p)
        if fields:
            total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU time of this process's reaped children (e.g. the epoch's reader processes)."""
    t = os.times()
    return t.children_user + t.children_system


@contextlib.contextmanager
def mounted(store: Path, mountpoint: Path, extra_args: Sequence[str] = (),
            log_file: Path | None = None, pythonpath: str | None = None) -> Iterator[Path]:
    """`dlfs mount MP --store STORE ...` for the duration of the block.

    Always unmounts in `finally` (`dlfs umount`, falling back to
    `fusermount3 -u -z`), and makes sure the daemon processes it started
    (main and workers, by pid) have exited.
    """
    mountpoint.mkdir(parents=True, exist_ok=True)
    args = ["mount", str(mountpoint), "--store", str(store), *extra_args]
    if log_file is not None and "--log-file" not in extra_args:
        args += ["--log-file", str(log_file)]
    pids: list[int] = []
    try:
        try:
            run_dlfs(args, pythonpath=pythonpath)
        except RuntimeError:
            if log_file is not None and log_file.exists():
                tail = log_file.read_text(errors="replace").splitlines()[-10:]
                print("daemon log (tail):\n  " + "\n  ".join(tail), file=sys.stderr)
            raise
        pid = _daemon_pid(mountpoint)
        pids = _daemon_pids(pid) if pid else []
        yield mountpoint
    finally:
        with _cleanup():
            _unmount(mountpoint, pids)


def daemon_alive(pids: Sequence[int]) -> bool:
    return any(_pid_alive(p) for p in pids)


def _unmount(mountpoint: Path, pids: list[int]) -> None:
    if not pids:
        pid = _daemon_pid(mountpoint)
        pids = _daemon_pids(pid) if pid else []
    if mounts_under(mountpoint):
        result = run_dlfs(["umount", str(mountpoint)], check=False)
        if result.returncode != 0 and mounts_under(mountpoint):
            print(f"WARNING: dlfs umount failed ({result.stderr.strip()}); "
                  "using fusermount3 -u -z", file=sys.stderr)
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
    # Only the daemon processes this context started, by pid (and still running dlfsd).
    for sig, wait in ((None, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        left = [p for p in pids if _pid_alive(p) and _is_dlfsd(p)]
        if not left:
            return
        if sig is not None:
            print(f"WARNING: daemon processes {left} still running; sending {sig.name}",
                  file=sys.stderr)
            for p in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(p) for p in left):
            time.sleep(0.02)


def read_ahead_kb(mountpoint: Path, set_to: int | None = None) -> int | None:
    """The kernel read-ahead (KiB) of the file system at mountpoint; optionally set it first.

    For a FUSE mount this also caps the size of READ requests for buffered reads.
    Returns None if /sys/class/bdi is not available (or not writable when setting).
    """
    st = os.stat(mountpoint)
    path = Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb")
    try:
        if set_to is not None:
            path.write_text(f"{set_to}\n")
        return int(path.read_text())
    except OSError as err:
        print(f"WARNING: cannot access {path}: {err.strerror}", file=sys.stderr)
        return None


# -- caches ------------------------------------------------------------------
PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")


@contextlib.contextmanager
def pipe_max_size(at_least: int | None) -> Iterator[None]:
    """Raise fs.pipe-max-size to `at_least` for the block (None: leave it), then restore.

    What a daemon without CAP_SYS_RESOURCE needs to splice 1 MiB read replies
    (see dlfsd.fuse.splicer); root on a real node has that capability.
    """
    if at_least is None:
        yield
        return
    before = int(PIPE_MAX_SIZE.read_text())
    if before >= at_least:
        yield
        return
    PIPE_MAX_SIZE.write_text(str(at_least))
    try:
        yield
    finally:
        PIPE_MAX_SIZE.write_text(str(before))


def splice_state() -> str:
    """What the daemon's spliced read replies can carry on this machine (one line)."""
    from dlfs.pipes import describe_pipe_size, usable_pipe_size

    return describe_pipe_size(usable_pipe_size())


def drop_caches() -> bool:
    """sync; echo 3 > /proc/sys/vm/drop_caches. Warns (once) if it cannot."""
    global _warned_cold
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as err:
        if not _warned_cold:
            print(f"WARNING: cannot drop caches ({err.strerror}); cold numbers are NOT cold "
                  "(run as root)", file=sys.stderr)
            _warned_cold = True
        return False


def sync() -> None:
    os.sync()


# -- reporting ---------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                title: str | None = None) -> None:
    """Left-aligned first column, right-aligned numbers; floats to 3 significant places."""
    def cell(v: object) -> str:
        if isinstance(v, float):
            if v != v:
                return "-"
            if abs(v) >= 100:
                return f"{v:,.0f}"
            return f"{v:#.3g}" if abs(v) < 1 else f"{v:.2f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    table = [[str(h) for h in headers]] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    if title:
        print(f"\n{title}")
    for n, r in enumerate(table):
        parts = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:],
                                                                      strict=True)]
        print("  " + "  ".join(parts).rstrip())
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


@dataclass
class Target:
    name: str
    value: float
    op: str  # ">=", "<=", "<"
    threshold: float
    unit: str = ""

    @property
    def ok(self) -> bool:
        if self.value != self.value:  # NaN
            return False
        return {">=": self.value >= self.threshold, "<=": self.value <= self.threshold,
                "<": self.value < self.threshold, ">": self.value > self.threshold}[self.op]

    def line(self) -> str:
        verdict = "PASS" if self.ok else "MISS"
        return (f"{verdict}  {self.name}: {self.value:.3f}{self.unit} "
                f"(target {self.op} {self.threshold:g}{self.unit})")


def ratio_line(label: str, value: float, baseline: float, unit: str = "") -> float:
    """Print `label: value / baseline = ratio` and return the ratio."""
    ratio = value / baseline if baseline else float("nan")
    print(f"  {label}: {value:,.2f}{unit} / {baseline:,.2f}{unit} = {ratio:.3f}")
    return ratio


def print_targets(targets: Sequence[Target], quick: bool) -> None:
    print("\ntargets" + (" (--quick: sizes shrunk, verdicts are indicative only)" if quick
                         else ""))
    for t in targets:
        print(t.line())


def fmt_s(seconds: float) -> str:
    return f"{seconds:.3f} s"

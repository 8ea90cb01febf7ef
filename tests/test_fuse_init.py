"""The datasets' FUSE connection answers INIT itself (dlfsd.fuse.rawsession), issue 32.

Two layers. `negotiate`, the whole INIT answer, is fed synthetic kernel INIT requests
as they come from kernels of several ages (with and without INIT_EXT, passthrough, the
request timeout, max_pages) and its reply is decoded field by field: this is the code
the daemon runs, not a stand-in. Then real mounts: what the kernel here granted is in
the log and in `dlfs status`, and with every worker SIGSTOPped a read fails within the
request timeout (plus the kernel's 15 s check interval) instead of hanging, and the
daemon takes the dead mount down once they continue. That test skips, saying why, on
a kernel without FUSE_REQUEST_TIMEOUT (Linux < 6.14).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dlfsd.base.kernel import kernel_version
from dlfsd.fuse import fusewire as fw
from dlfsd.fuse import rawsession as rs

UNIQUE = 2
INIT_REST = 11 * 4  # fuse_init_in's unused[11]

# What kernels offer in INIT (fs/fuse/inode.c, fuse_send_init), by age.
OLD_FLAGS = (rs.ASYNC_READ | rs.ATOMIC_O_TRUNC | rs.BIG_WRITES | rs.AUTO_INVAL_DATA
             | rs.DO_READDIRPLUS | rs.READDIRPLUS_AUTO | rs.PARALLEL_DIROPS | rs.ABORT_ERROR
             | rs.MAX_PAGES | rs.CACHE_SYMLINKS)
KERNEL_5_4 = (31, OLD_FLAGS)  # no INIT_EXT: flags2 is not there to read
KERNEL_6_9 = (40, OLD_FLAGS | rs.INIT_EXT | rs.PASSTHROUGH)  # no request timeout
KERNEL_6_18 = (45, OLD_FLAGS | rs.INIT_EXT | rs.PASSTHROUGH | rs.REQUEST_TIMEOUT)


def init_request(minor: int, offered: int, major: int = 7, opcode: int = fw.INIT,
                 flags2_garbage: int = 0) -> bytes:
    """A kernel's INIT request: header, fuse_init_in (flags2 only with INIT_EXT)."""
    flags2 = offered >> 32 if offered & rs.INIT_EXT else flags2_garbage
    body = rs.INIT_IN.pack(major, minor, 128 << 10, offered & 0xFFFFFFFF, flags2, 0)
    body += b"\0" * (INIT_REST - 4)
    head = fw.IN_HEADER.pack(fw.IN_HEADER.size + len(body), opcode, UNIQUE, 0, 0, 0, 1, 0, 0)
    return head + body


def decode(reply: bytes) -> dict:
    """The reply as the kernel reads it: header, then fuse_init_out."""
    length, error, unique = fw.OUT_HEADER.unpack_from(reply)
    assert (length, error, unique) == (len(reply), 0, UNIQUE)
    assert length == fw.OUT_HEADER.size + 64  # sizeof(struct fuse_init_out)
    (major, minor, readahead, flags, max_background, congestion, max_write, time_gran,
     max_pages, map_alignment, flags2, max_stack_depth, request_timeout,
     *unused) = rs.INIT_OUT.unpack_from(reply, fw.OUT_HEADER.size)
    assert not any(unused)
    # the kernel's defaults for background requests, ns time stamps, no DAX
    assert (max_background, congestion, time_gran, map_alignment) == (0, 0, 1, 0)
    return {"major": major, "minor": minor, "readahead": readahead,
            "flags": flags | flags2 << 32, "max_write": max_write, "max_pages": max_pages,
            "max_stack_depth": max_stack_depth, "request_timeout": request_timeout}


# -- negotiate: synthetic INIT requests -------------------------------------------------
def test_a_current_kernel_grants_what_a_read_only_dataset_mount_asks():
    reply, got = rs.negotiate(init_request(*KERNEL_6_18), rs.dataset_wants(600))
    out = decode(reply)
    for flag in (rs.PARALLEL_DIROPS, rs.MAX_PAGES, rs.REQUEST_TIMEOUT, rs.DO_READDIRPLUS,
                 rs.ABORT_ERROR, rs.CACHE_SYMLINKS, rs.INIT_EXT):
        assert out["flags"] & flag and got.has(flag), rs.FLAG_NAMES[flag]
    # offered, and refused: nothing is written on a dataset mount, and every listing
    # reply carries attributes (readdirplus_auto would send them with the first only)
    for flag in (rs.ATOMIC_O_TRUNC, rs.BIG_WRITES, rs.PASSTHROUGH, rs.READDIRPLUS_AUTO):
        assert not out["flags"] & flag and not got.has(flag), rs.FLAG_NAMES[flag]
    assert out["flags"] == got.granted
    assert (out["major"], out["minor"], got.minor, got.kernel_minor) == (7, 40, 40, 45)
    assert out["request_timeout"] == 600 and got.request_timeout == 600
    assert out["max_pages"] == 256 and got.max_pages == 256
    assert out["readahead"] == 128 << 10  # as offered: the daemon sets its own after INIT
    assert out["max_stack_depth"] == 0
    line = got.describe(rs.dataset_wants(600))
    assert "parallel_dirops" in line and "request timeout 600 s" in line
    assert "not offered" not in line
    report = got.report(rs.dataset_wants(600))
    assert report["not_granted"] == [] and "atomic_o_trunc" not in report["granted"]


def test_a_kernel_without_request_timeouts_is_told_none_and_it_is_said():
    """Linux 6.9-6.13: INIT_EXT and passthrough, no FUSE_REQUEST_TIMEOUT."""
    wants = rs.dataset_wants(600)
    reply, got = rs.negotiate(init_request(*KERNEL_6_9), wants)
    out = decode(reply)
    assert not out["flags"] & rs.REQUEST_TIMEOUT and not got.has(rs.REQUEST_TIMEOUT)
    assert out["request_timeout"] == 0 and got.request_timeout == 0
    assert out["flags"] & rs.PARALLEL_DIROPS and out["max_pages"] == 256
    assert got.report(wants)["not_granted"] == ["request_timeout"]
    assert "no request timeout (the kernel does not offer one" in got.describe(wants)


def test_a_kernel_without_init_ext_gets_no_high_flags_whatever_flags2_holds():
    """Before 7.36 there is no flags2: whatever is in its place is not an offer."""
    reply, got = rs.negotiate(init_request(*KERNEL_5_4, flags2_garbage=0xFFFFFFFF),
                              rs.dataset_wants(600))
    out = decode(reply)
    assert out["flags"] >> 32 == 0 and got.offered >> 32 == 0
    assert not got.has(rs.REQUEST_TIMEOUT) and not got.has(rs.INIT_EXT)
    assert (out["minor"], got.kernel_minor) == (31, 31)  # the kernel's, being older
    assert got.has(rs.PARALLEL_DIROPS) and got.max_pages == 256


def test_no_max_pages_offered_means_the_kernels_128k_requests():
    reply, got = rs.negotiate(init_request(40, KERNEL_6_9[1] & ~rs.MAX_PAGES),
                              rs.dataset_wants(0))
    assert not decode(reply)["flags"] & rs.MAX_PAGES
    assert got.max_pages == rs.DEFAULT_MAX_PAGES


def test_the_kernels_caps_decide_the_timeout_in_force():
    """fs.fuse.max_request_timeout caps ours, 15 s is the least the kernel takes,
    default_request_timeout applies when we ask none, max_pages_limit caps max_pages."""
    request = init_request(*KERNEL_6_18)
    capped = rs.KernelLimits(max_pages=128, max_request_timeout=60)
    _, got = rs.negotiate(request, rs.dataset_wants(600), capped)
    assert (got.request_timeout, got.max_pages) == (60, 128)
    reply, got = rs.negotiate(request, rs.dataset_wants(5))
    assert decode(reply)["request_timeout"] == 5 and got.request_timeout == 15
    reply, got = rs.negotiate(request, rs.dataset_wants(0),
                              rs.KernelLimits(default_request_timeout=30))
    out = decode(reply)
    assert not out["flags"] & rs.REQUEST_TIMEOUT and out["request_timeout"] == 0
    assert got.request_timeout == 30  # the kernel's own default, not asked by us
    _, got = rs.negotiate(request, rs.dataset_wants(70_000))
    assert got.request_timeout == rs.MAX_REQUEST_TIMEOUT  # a u16 on the wire


def test_the_checkpoint_connection_keeps_its_own_answer():
    """Atomic O_TRUNC and 1 MiB writes; passthrough (and its stack depth) only if offered
    and wanted; no request timeout asked."""
    reply, got = rs.negotiate(init_request(*KERNEL_6_18), rs.ckpt_wants(True))
    out = decode(reply)
    assert got.passthrough and out["max_stack_depth"] == rs.MAX_STACK_DEPTH
    assert out["flags"] & rs.ATOMIC_O_TRUNC and out["flags"] & rs.BIG_WRITES
    assert not out["flags"] & rs.REQUEST_TIMEOUT and out["request_timeout"] == 0
    reply, got = rs.negotiate(init_request(*KERNEL_6_18), rs.ckpt_wants(False))
    assert not got.passthrough and decode(reply)["max_stack_depth"] == 0
    _, got = rs.negotiate(init_request(*KERNEL_5_4), rs.ckpt_wants(True))
    assert not got.passthrough


def test_a_request_that_is_no_init_or_another_major_is_refused():
    with pytest.raises(rs.InitRefused) as refused:
        rs.negotiate(init_request(*KERNEL_6_18, major=8), rs.dataset_wants(600))
    assert refused.value.errno == errno.EPROTO
    assert fw.OUT_HEADER.unpack(refused.value.reply) == (16, -errno.EPROTO, UNIQUE)
    with pytest.raises(rs.InitRefused) as refused:
        rs.negotiate(init_request(*KERNEL_6_18, opcode=fw.LOOKUP), rs.dataset_wants(600))
    assert refused.value.reply is None


# -- real mounts ---------------------------------------------------------------------
def kernel_has_request_timeout() -> bool:
    """FUSE_REQUEST_TIMEOUT came with Linux 6.14 (protocol 7.43)."""
    return kernel_version(os.uname().release) >= (6, 14)


def status_of(dlfs_cli, m) -> dict:
    result = dlfs_cli("status", m.path, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def small_store(store_with, tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(8):
        (src / "d" / f"f{i}").write_bytes(bytes([i]) * 5000)
    return store_with(src)


def test_a_mount_logs_and_reports_what_the_kernel_granted(mounted, small_store, dlfs_cli):
    m = mounted(small_store, "--request-timeout", "120")
    assert (m / "ds/d/f3").read_bytes() == b"\3" * 5000
    fuse = status_of(dlfs_cli, m)["fuse"]
    assert {"parallel_dirops", "max_pages", "readdirplus", "abort_error"} <= set(
        fuse["granted"])
    assert not {"atomic_o_trunc", "readdirplus_auto"} & set(fuse["granted"])
    assert fuse["max_pages"] == min(256, rs.KernelLimits.read().max_pages)
    if kernel_has_request_timeout():
        assert "request_timeout" in fuse["granted"] and fuse["request_timeout"] >= 120
    else:
        assert fuse["not_granted"] == ["request_timeout"] and fuse["request_timeout"] == 0
    lines = [line for line in m.log_text().splitlines() if "FUSE connection" in line]
    assert len(lines) == 1 and "parallel_dirops" in lines[0], lines  # once, at mount
    assert " INFO " in lines[0]
    plain = dlfs_cli("status", m.path).stdout
    assert "FUSE protocol 7." in plain and "parallel_dirops" in plain


def test_no_request_timeout_asked_none_granted(mounted, small_store, dlfs_cli):
    m = mounted(small_store, "--request-timeout", "0")
    fuse = status_of(dlfs_cli, m)["fuse"]
    assert "request_timeout" not in fuse["granted"] + fuse["not_granted"]


def fuse_workers(main_pid: int) -> list[int]:
    """The main daemon process's children that hold /dev/fuse: its FUSE workers."""
    found = []
    for task in os.listdir(f"/proc/{main_pid}/task"):
        with open(f"/proc/{main_pid}/task/{task}/children") as f:
            for pid in map(int, f.read().split()):
                try:
                    fds = os.listdir(f"/proc/{pid}/fd")
                except OSError:
                    continue
                if any(_readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse" for fd in fds):
                    found.append(pid)
    return found


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def test_stopped_workers_fail_a_read_within_the_request_timeout(mounted, small_store,
                                                                  dlfs_cli, sysproc):
    """Every worker SIGSTOPped: the kernel aborts the connection once a request waits past
    the timeout (it checks every 15 s: the error comes between T and T + 15 s), the read
    fails instead of hanging, and once the workers continue the daemon finds its
    connection aborted and takes the dead mount down."""
    if not kernel_has_request_timeout():
        pytest.skip(f"kernel {os.uname().release} has no FUSE_REQUEST_TIMEOUT (Linux >= "
                    "6.14): a stopped daemon leaves readers waiting")
    timeout = 15  # the least the kernel takes
    m = mounted(small_store, "--request-timeout", str(timeout))
    assert status_of(dlfs_cli, m)["fuse"]["request_timeout"] == timeout
    workers = fuse_workers(m.pid)
    assert workers, "no worker process holds /dev/fuse"
    reader = [sys.executable, "-c", "import sys; open(sys.argv[1], 'rb').read()",
              str(m / "ds/d/f5")]
    try:
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        result = subprocess.run(reader, capture_output=True, text=True,
                                timeout=timeout + rs.TIMEOUT_CHECK_SECONDS + 30)
        took = time.monotonic() - started
    finally:
        for pid in workers:  # whatever happened: no process left stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert result.returncode != 0
    assert "Software caused connection abort" in result.stderr or \
        "Transport endpoint is not connected" in result.stderr, result.stderr
    assert timeout - 1 <= took <= timeout + rs.TIMEOUT_CHECK_SECONDS + 5, took
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (sysproc.pid_alive(m.pid)
                                           or sysproc.fstype_at(m.path)):
        time.sleep(0.2)
    assert not sysproc.pid_alive(m.pid), "the daemon did not notice its aborted connection"
    assert sysproc.fstype_at(m.path) is None, "the dead mount is still there"
    assert "FUSE connection was aborted" in m.log_text()


def test_every_listing_reply_carries_attributes(mounted, store_with, tmp_path):
    """A directory larger than one READDIRPLUS reply (~6,000 entries of 1 MiB): with
    readdirplus_auto the kernel asked for the rest as plain READDIR, and each later
    stat of those entries cost a LOOKUP round trip. Now a listing leaves every entry
    known to the kernel: stat'ing all 9,000 afterwards sends no LOOKUP (the daemon's
    --debug log has one line per request it reads)."""
    src = tmp_path / "src"
    (src / "big").mkdir(parents=True)
    for i in range(9000):
        (src / "big" / f"sample_{i:07d}.bin").touch()
    m = mounted(store_with(src), "--debug")
    big = m / "ds/big"
    names = [entry.name for entry in os.scandir(big)]
    assert len(names) == 9000
    before = m.log_text().count(" lookup inode ")
    for name in names:
        os.lstat(big / name)
    lookups = m.log_text().count(" lookup inode ") - before
    assert lookups == 0, f"{lookups} LOOKUPs after the listing"
    plus = m.log_text().count(" readdirplus inode ")
    assert plus >= 2, "the listing took one READDIRPLUS reply"

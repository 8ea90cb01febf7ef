"""dlfsd.base.lineage: a forked process dies with its parent, also when the parent died first.

Real processes: a helper script makes itself a child subreaper (so orphans are
reparented to it, not to init, and it can reap them and see how they ended),
forks a "parent", which forks the child under test; then the parent is killed.
Through a real mount: tests/test_lifecycle.py
(test_a_killed_main_process_takes_its_workers_and_the_mount_down).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = r"""
import ctypes, os, signal, sys, time
from dlfsd.base.lineage import die_with_parent

PR_SET_CHILD_SUBREAPER = 36
assert ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
case = sys.argv[1]
ready_r, ready_w = os.pipe()
parent = os.fork()
if parent == 0:
    me = os.getpid()
    child = os.fork()
    if child == 0:
        os.close(ready_r)
        if case == "parent dies first":
            while os.getppid() == me:  # the parent exits at once: wait until it did
                time.sleep(0.001)
        alive = die_with_parent(me)
        os.write(ready_w, b"alive\n" if alive else b"gone\n")
        if not alive:
            os._exit(7)
        time.sleep(60)  # until the death signal (SIGTERM, default action) ends us
        os._exit(0)
    if case == "parent dies first":
        os._exit(0)
    time.sleep(60)  # until killed
    os._exit(0)
os.close(ready_w)
said = os.read(ready_r, 16).decode().strip()
if case == "parent is killed":
    os.kill(parent, signal.SIGKILL)
ended = {}
while len(ended) < 2:  # the parent, and the child it left to us
    pid, status = os.wait()
    ended[pid] = status
child_status = next(s for p, s in ended.items() if p != parent)
how = (signal.Signals(os.WTERMSIG(child_status)).name if os.WIFSIGNALED(child_status)
       else f"exit {os.WEXITSTATUS(child_status)}")
print(said, how)
"""


def run_case(case: str) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", _SCRIPT, case], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the child outlived its parent (no death signal)")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_child_gets_sigterm_when_its_parent_is_killed():
    assert run_case("parent is killed") == "alive SIGTERM"


def test_a_child_whose_parent_died_before_the_request_is_told_so():
    """The death signal is only sent for a parent that dies after prctl: one that died
    between fork and prctl must be caught by the check, or the child serves on."""
    assert run_case("parent dies first") == "gone exit 7"

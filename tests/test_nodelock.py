"""NodeLock (dlfsd.ckpt.nodelock), the checkpoint tier's lock for all processes and
threads of a daemon: two threads entering a fresh lock at once (the drain's threads
publishing two files together) both get it in turn; it used to deadlock there, the
tier's every process then waiting for it (a flush that never returned)."""

from __future__ import annotations

import os
import threading
import time

from dlfsd.ckpt.nodelock import NodeLock


def test_threads_entering_a_fresh_lock_at_once_take_it_in_turn(tmp_path):
    for i in range(100):
        lock = NodeLock(str(tmp_path / f"lock{i}"))
        barrier = threading.Barrier(3)
        inside, most, done = [0], [0], []

        def enter(lock=lock, barrier=barrier, inside=inside, most=most, done=done):
            barrier.wait()
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                time.sleep(0.001)
                inside[0] -= 1
            done.append(1)

        threads = [threading.Thread(target=enter, daemon=True) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        assert len(done) == 3, f"fresh lock {i}: deadlocked"
        assert most[0] <= 1, "two threads held the lock at once"


def test_a_forked_process_is_excluded_while_the_parent_holds_it(tmp_path):
    lock = NodeLock(str(tmp_path / "lock"))
    with lock:
        pass  # set up in the parent before the fork, as the daemon's are
    read, write = os.pipe()
    with lock:
        pid = os.fork()
        if pid == 0:  # the child: waits for the parent's release, then says so
            try:
                with lock:
                    os.write(write, b"in")
            finally:
                os._exit(0)
        time.sleep(0.3)
        os.set_blocking(read, False)
        try:
            early = os.read(read, 2)
        except BlockingIOError:
            early = b""
        assert early == b"", "the child took the lock the parent holds"
    os.set_blocking(read, True)
    assert os.read(read, 2) == b"in"
    assert os.waitpid(pid, 0)[1] == 0
    os.close(read)
    os.close(write)

"""dlfsd.base.buffers.lazy_buffer: 4 MiB receive buffers that cost only what is written.

Each peer client holds a buffer of the largest frame (4 MiB); the look-ahead's fetch
threads have one each. As bytearrays they put 4 MiB each into the RSS at once.
"""

from __future__ import annotations

import os
import resource

from dlfsd.base.buffers import lazy_buffer
from dlfsd.pool import protocol
from dlfsd.pool.peersync import BlockingPeerClient

PAGE = resource.getpagesize()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_peer_clients_with_buffers_of_their_own_cost_only_what_they_receive():
    before = resident_bytes()
    clients = [BlockingPeerClient(b"s" * 32, "n", "127.0.0.1", 9, own_buffer=True)
               for _ in range(16)]
    for client in clients:  # a 110 KiB reply lands in each
        client._frame[: 110 << 10] = b"x" * (110 << 10)
    grown = resident_bytes() - before
    # 16 x 4 MiB as bytearrays; what was written (16 x 110 KiB) and the objects now
    assert grown < 8 << 20, f"RSS grew {grown >> 20} MiB for 16 clients"
    assert len(clients[0]._frame) > protocol.MAX_FRAME


def test_a_forked_process_writes_its_own_copy():
    buf = lazy_buffer(1 << 20)
    buf[:5] = b"hello"
    pid = os.fork()
    if pid == 0:
        buf[:5] = b"child"
        os._exit(0 if bytes(buf[:5]) == b"child" else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(buf[:5]) == b"hello" and bytes(buf[5:10]) == bytes(5)

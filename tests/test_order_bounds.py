"""The order socket against hostile input: bounded bodies, and whom a sampler talks to.

Real mounts with a real root daemon; the other users are throw-away system users
(tests/sysusers.py) running a small impostor server. What is checked:

- a registration or announcement body over its limit is refused in one line,
  before the daemon reads it, and the daemon serves the next client as before;
- the client refuses a socket held by a user who is neither root nor itself;
- a user who binds the name today's daemons would have used, before the mount,
  does not capture the mount's samplers.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
from sysusers import temp_user, user_python

from dlfs.order.client import OrderClient, OrderClientError, connect

pytestmark = pytest.mark.usefixtures("daemon_guard")

FILES = 40


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("bounds-src")
    rng = np.random.default_rng(3)
    for i in range(FILES):
        (src / f"f{i:03d}").write_bytes(rng.bytes(20_000))
    return store_with(src, "ds", "256K")


def mount_paths(mount) -> list[str]:
    return [os.path.join(mount.path, "ds", f"f{i:03d}") for i in range(FILES)]


def test_oversized_bodies_are_refused_in_one_line_and_the_daemon_serves_on(
        mounted, small_store):
    mount = mounted(small_store)
    paths = mount_paths(mount)
    # 100,000 paths (1.4 MB) for a mount of ~40 entries: over 64 KiB, refused.
    with pytest.raises(OrderClientError) as refused:
        OrderClient(str(mount.path), [paths[0]] * 100_000)
    line = str(refused.value)
    assert "\n" not in line and "over this mount's limit of 64.0 KiB" in line, line
    assert "register only paths of files in" in line

    # Refused from the header alone: a body announced but never sent gets its line at
    # once (not after the daemon's 30 s wait for the body).
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(b"\0" + (mount.path / ".dlfs" / "order").read_bytes().strip())
        started = time.monotonic()
        sock.sendall(json.dumps({"op": "register", "body": 1 << 30}).encode() + b"\n")
        reply = sock.makefile("rb").readline()
        assert time.monotonic() - started < 5
    answer = json.loads(reply)
    assert answer["ok"] is False and "over this mount's limit" in answer["error"]

    client = connect(paths)  # the daemon serves on
    assert client is not None and client.unknown == 0
    with pytest.raises(OrderClientError, match="longer than its registration's 40 samples"):
        client.announce(0, np.arange(FILES * 100) % FILES)
    client.announce(0, np.arange(FILES))
    status = client.status()
    assert [s["samples"] for s in status["streams"]] in ([FILES], [])  # [] once read ahead
    assert status["held_bytes"] <= status["memory_limit"]
    assert open(paths[1], "rb").read()  # noqa: SIM115
    refusals = [ln for ln in mount.log_text().splitlines() if "over this mount's limit" in ln]
    assert len(refusals) == 2, refusals  # logged once each


# Run as another user: listen on an abstract name, answer a registration as a daemon
# would (every sample on node 7 of 9), and say on stdout who connected.
IMPOSTOR = r"""
import json, os, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.bind(b"\0" + bytes.fromhex(sys.argv[1]))
sock.listen(8)
print("listening", os.getpid(), flush=True)
while True:
    conn, _ = sock.accept()
    print("connected", flush=True)
    conn.settimeout(5)
    try:
        data = b""
        while b"\n" not in data:
            data += conn.recv(65536) or b"\n"
        line, _, body = data.partition(b"\n")
        header = json.loads(line or b"{}")
        while len(body) < header.get("body", 0):
            more = conn.recv(1 << 20)
            if not more:
                break
            body += more
        if header.get("op") == "register":
            n = body.count(b"\n") + 1
            reply = {"ok": True, "handle": 1, "node": 7, "node_count": 9, "samples": n,
                     "chunks": 1, "unknown": 0, "body": 8 * n + 4}
            conn.sendall(json.dumps(reply).encode() + b"\n" + bytes(8 * n) + b"\x07\0\0\0")
            print("fed a sampler", flush=True)
        else:
            conn.sendall(b'{"ok": true, "samples": 0, "streams": [], "counters": {}}\n')
    except OSError:
        pass
    conn.close()
"""


def start_impostor(user, name: bytes) -> tuple[subprocess.Popen, int]:
    """The impostor server as `user`, listening on abstract `name` (without NUL): its
    runuser process and the server's pid."""
    python = user_python(user)
    proc = subprocess.Popen(["runuser", "-u", user.name, "--", python, "-c", IMPOSTOR,
                             name.hex()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    word, _, pid = proc.stdout.readline().strip().partition(" ")
    if word != "listening":
        proc.kill()
        pytest.fail(f"the impostor did not start: {word} {proc.stderr.read()}")
    return proc, int(pid)


def stop_impostor(impostor: tuple[subprocess.Popen, int]) -> str:
    """Kill the server (runuser does not pass on a kill); what it saw, from its stdout."""
    proc, pid = impostor
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=10)
    return out


def test_the_client_refuses_a_socket_held_by_another_user(mounted, small_store):
    mount = mounted(small_store)
    name = f"dlfs-impostor-{os.urandom(8).hex()}".encode()
    with temp_user() as other:
        impostor = start_impostor(other, name)
        try:
            with pytest.raises(OrderClientError) as refused:
                OrderClient(str(mount.path), mount_paths(mount), socket_name=b"\0" + name)
        finally:
            seen = stop_impostor(impostor)
    line = str(refused.value)
    assert "\n" not in line and f"held by uid {other.uid}" in line, line
    assert "neither root nor you" in line
    assert "fed a sampler" not in seen  # nothing was sent to it


def test_a_squatted_socket_name_does_not_capture_a_sampler(mounted, small_store):
    """Another user binds, before the mount, the name a daemon of this mountpoint took
    until now (derived from the mountpoint alone): the daemon listens elsewhere, the
    sampler finds it through the mount, and the squatter sees no one."""
    mountpoint = mounted.new_mountpoint()
    key = hashlib.sha1(os.fsencode(os.path.realpath(mountpoint))).hexdigest()[:16]
    with temp_user() as other:
        squatter = start_impostor(other, b"dlfs-order-" + key.encode())
        try:
            mount = mounted(small_store, mountpoint=mountpoint)
            client = connect(mount_paths(mount))
            locality = client.locality()
            client.announce(0, np.arange(FILES))
        finally:
            seen = stop_impostor(squatter)
    assert (locality.node, locality.node_count) == (0, 1)  # the daemon's answer
    assert locality.sample_chunk.min() >= 0
    assert "connected" not in seen
    assert "cannot listen" not in mount.log_text()


def test_what_all_clients_announce_together_stays_within_the_memory_limit(
        mounted, small_store):
    """Many samplers each announcing a long epoch: the look-ahead keeps what they hold
    within its limit (160 B per entry of the mount, at least 256 KiB) by dropping the
    oldest streams, and the newest announcement is followed."""
    mount = mounted(small_store)
    paths = mount_paths(mount) * 27  # 1080 samples: each a file of the mount, repeated
    clients = [connect(paths) for _ in range(20)]  # one resolution, 20 handles
    for client in clients:
        client.announce(0, np.arange(len(paths)))  # ~28 KB held per stream
    status = clients[-1].status()
    handles = [s["handle"] for s in status["streams"]]
    assert clients[-1].handle in handles and clients[0].handle not in handles
    assert status["memory_limit"] == 256 << 10
    assert status["held_bytes"] <= status["memory_limit"], status["held_bytes"]
    assert status["counters"]["streams_dropped_full"] >= 20 - 256 * 1024 // (1080 * 26)
    assert "memory limit of" in mount.log_text()

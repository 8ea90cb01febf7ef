"""A stand-in for the daemon's chunk pool, for tests that run a real PeerLoopServer.

It keeps one dataset's chunks in real files, like staged copies (it is what the
server reads from, not what is under test), and can be made slow, stuck or failing:
that is how tests make a server that does not answer or a copy that cannot be read.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

SECRET = b"job-secret-0123456789abcdef"
DATASET = os.urandom(16)
HEADER = 64  # bytes before a chunk's data in its staged file


class FileProvider:
    """`chunks` staged in files under `directory`. `lengths` (default: the chunks')
    may name more chunks than are staged: those are valid but not here (MISS).
    Reading chunk `failing` raises EIO; reads can be delayed or held at a gate."""

    def __init__(self, directory: Path, chunks: list[bytes], lengths: list[int] | None = None,
                 failing: int | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.chunks = chunks
        self.lengths = lengths if lengths is not None else [len(c) for c in chunks]
        self.failing = failing
        self.delay = 0.0
        self.gate: threading.Event | None = None  # the server waits for it when set
        self.lookups = 0
        self.failed_copies: list[tuple[bytes, int]] = []  # what the server reported broken
        self.fds = []
        for i, data in enumerate(chunks):
            path = directory / f"chunk{i}"
            path.write_bytes(b"h" * HEADER + data)
            self.fds.append(os.open(path, os.O_RDONLY))

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)

    def chunk_limit(self, dataset_id: bytes, chunk: int) -> int | None:
        if dataset_id != DATASET or chunk >= len(self.lengths):
            return None
        return self.lengths[chunk]

    def will_stage(self, dataset_id: bytes, chunk: int) -> bool:
        return True

    def staged_file(self, dataset_id: bytes, chunk: int) -> tuple[int, int] | None:
        self.lookups += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        if chunk == self.failing:
            raise OSError(5, "Input/output error")
        if chunk >= len(self.chunks):
            return None
        return self.fds[chunk], HEADER

    def staged_copy_failed(self, dataset_id: bytes, chunk: int, fd: int) -> bool:
        self.failed_copies.append((dataset_id, chunk))
        return False  # this stand-in cannot evict: the copy stays broken


async def version_1_server(stream, hellos: list[int], chunk: bytes) -> None:
    """One connection of a daemon that speaks protocol version 1 only (an older DLFS
    in the same job): it refuses any other HELLO with ERR version, as version 1 did, and
    serves READs of `chunk`. `hellos` collects the versions offered; a REPORT (which
    version 1 has not) ends the connection and is recorded as -1."""
    from dlfsd.pool import protocol

    decoder = protocol.FrameDecoder()
    pending: list[dict] = []

    async def message() -> dict | None:
        while not pending:
            data = await stream.receive_some()
            if not data:
                return None
            pending.extend(decoder.feed(data))
        return pending.pop(0)

    hello = await message()
    hellos.append(hello["v"])
    if hello["v"] != 1:
        await stream.send_all(protocol.encode(protocol.err(
            protocol.ERR_VERSION, f"node old speaks protocol version 1, not {hello['v']}")))
        return
    nonce = protocol.new_nonce()
    await stream.send_all(protocol.encode(protocol.challenge(
        nonce, protocol.server_proof(SECRET, hello["nonce"], nonce))))
    await message()  # AUTH
    await stream.send_all(protocol.encode(protocol.ok()))
    while (request := await message()) is not None:
        if request["t"] != protocol.READ:
            hellos.append(-1)
            return
        payload = chunk[request["off"] : request["off"] + request["len"]]
        await stream.send_all(protocol.encode(protocol.data(request["id"], payload)))

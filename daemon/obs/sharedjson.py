"""SharedJson: a small JSON document one process publishes and any process reads.

The pool's health is gathered in the main process (only it knows the stager's
state and has scanned the stall slots), but `.dlfs/metrics` is rendered by
whichever worker process the reader's request reaches. So the main process
publishes what it gathered, once a second, into an anonymous shared mmap made
before the fork, and a worker reads the latest copy when it renders.

One writer; readers never block it: a generation counter is odd while a write
is in progress (a seqlock), and a reader that sees it odd, or changed after it
copied the bytes, tries again.
"""

from __future__ import annotations

import json
import mmap
import struct

_WORD = struct.Struct("<q")  # the header: generation (odd: being written), then length
_HEADER_SIZE = 2 * _WORD.size
_TRIES = 100


class SharedJson:
    """`publish(dict)` in one process, `read()` in any; {} until the first publish."""

    def __init__(self, capacity: int = 256 << 10) -> None:
        self.capacity = capacity
        self._mm = mmap.mmap(-1, _HEADER_SIZE + capacity)
        self._generation = 0

    def publish(self, doc: dict, fallback: dict | None = None) -> bool:
        """Publish `doc`; if it does not fit, `fallback` (something smaller) instead.
        False if neither fits (the previous document stays)."""
        for candidate in (doc, fallback):
            if candidate is None:
                continue
            data = json.dumps(candidate, separators=(",", ":")).encode()
            if len(data) <= self.capacity:
                self._write(data)
                return True
        return False

    def _write(self, data: bytes) -> None:
        self._generation += 1  # odd: readers wait
        _WORD.pack_into(self._mm, 0, self._generation)
        self._mm[_HEADER_SIZE : _HEADER_SIZE + len(data)] = data
        _WORD.pack_into(self._mm, _WORD.size, len(data))
        self._generation += 1
        _WORD.pack_into(self._mm, 0, self._generation)

    def read(self) -> dict:
        for _ in range(_TRIES):
            generation = _WORD.unpack_from(self._mm, 0)[0]
            if generation & 1:
                continue
            length = _WORD.unpack_from(self._mm, _WORD.size)[0]
            data = self._mm[_HEADER_SIZE : _HEADER_SIZE + length]
            if _WORD.unpack_from(self._mm, 0)[0] == generation:
                return json.loads(data) if data else {}
        return {}  # the writer kept writing: the next render gets it

    def close(self) -> None:
        self._mm.close()

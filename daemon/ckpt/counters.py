"""WriteCounter: bytes written into the checkpoint tier, one shared word per process
(each process adds to its own slot, dlfsd.base.slots: no lock, no lost update)."""

from __future__ import annotations

import mmap

from dlfsd.base.slots import ProcessSlot


class WriteCounter:
    def __init__(self, slot: ProcessSlot) -> None:
        self.slot = slot
        self._mm = mmap.mmap(-1, 16 * slot.count)
        self._words = memoryview(self._mm).cast("q")  # [bytes, requests] per process

    def add(self, nbytes: int) -> None:
        i = 2 * self.slot.index
        self._words[i] += nbytes
        self._words[i + 1] += 1

    def totals(self) -> tuple[int, int]:
        """(bytes, write requests) of all processes."""
        return sum(self._words[0::2]), sum(self._words[1::2])

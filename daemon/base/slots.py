"""ProcessSlot: which of the daemon's processes this is (0 = main, 1.. = forked workers).

Counters and trace rings live in shared memory made before the workers fork;
each process writes only its own slice (its slot), so no two processes ever
update the same word and no update is lost without any lock. The slot is
claimed at fork time by `os.register_at_fork`, so the daemon's lifecycle code
needs no extra call: the n-th fork made by the main process gets slot n.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable


class ProcessSlot:
    """The slot index of the current process, among `count` slots."""

    def __init__(self, count: int) -> None:
        self.count = max(1, count)
        self.index = 0
        self._forks = 0
        self._listeners: list[Callable[[int], None]] = []
        ref = weakref.ref(self)
        os.register_at_fork(after_in_parent=lambda: _call(ref, "_forked_child"),
                            after_in_child=lambda: _call(ref, "_became_child"))

    def on_change(self, listener: Callable[[int], None]) -> None:
        """Call `listener(index)` in a forked child once it has its slot."""
        self._listeners.append(listener)

    def _forked_child(self) -> None:
        self._forks += 1

    def _became_child(self) -> None:
        # A process forked by a worker (none today) would share its parent's
        # slot; one past the last slot would write out of bounds: clamp.
        if self.index == 0:
            self.index = min(self._forks + 1, self.count - 1)
        self._forks = 0
        for listener in self._listeners:
            listener(self.index)


def _call(ref: weakref.ref, method: str) -> None:
    slot = ref()
    if slot is not None:
        getattr(slot, method)()

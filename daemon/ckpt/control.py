"""CkptControl: `dlfs flush` on the daemon's side (answered in the control process,
dlfsd.obs.controlsock).

`ckpt-flush HEXPATH` queues every file under PATH (hex of its bytes relative to
`MOUNTPOINT/ckpt/`, `-` for all) whose local bytes the store lacks, to be drained at
once, closed or not; the reply's `since` marks "written so far". `ckpt-pending
HEXPATH SINCE` answers how many of the files under PATH that were pending by then
are still not on the store (files, bytes, some names, the last drain error). The
client asks again until none are left: a flush that waits minutes holds no
connection, and `dlfs trace` stays answered meanwhile.
"""

from __future__ import annotations

import os
import stat
import time

from dlfsd.ckpt.drain import scan
from dlfsd.ckpt.tier import Tier

SAMPLE_NAMES = 10


class CkptControl:
    def __init__(self, tier: Tier) -> None:
        self.tier = tier

    def handle(self, words: list[str]) -> dict:
        if words[0] == "ckpt-flush" and len(words) == 2:
            under = self._under(words[1])
            since = time.time_ns()
            # Rows it adds are pending since `since`: the flush waits for them too (a
            # file drained while open and written since had none).
            queued = scan(self.tier, under, force=True, now_ns=since)
            return {"ok": True, "since": since, "files": len(queued),
                    "store": self.tier.store}
        if words[0] == "ckpt-pending" and len(words) == 3:
            return {"ok": True, **self.pending(self._under(words[1]), int(words[2]))}
        return {"ok": False, "error": f"bad checkpoint command {' '.join(words)!r}"}

    def _under(self, word: str) -> bytes | None:
        if word == "-":
            return None
        under = bytes.fromhex(word)
        if not os.path.lexists(os.path.join(self.tier.tree_bytes, under)):
            raise FileNotFoundError(f"no {os.fsdecode(under)} in the checkpoint directory")
        return under

    def pending(self, under: bytes | None, since: int) -> dict:
        rows = {ino: (since_ns, error) for ino, since_ns, _, error in
                self.tier.state.pending_rows() if since_ns <= since}
        files = nbytes = 0
        names, error = [], None
        top = self.tier.tree_bytes if under is None else os.path.join(self.tier.tree_bytes,
                                                                       under)
        for path in _files(top):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            row = rows.get(st.st_ino)
            if row is None:
                continue
            files += 1
            nbytes += st.st_size
            error = error or row[1]
            if len(names) < SAMPLE_NAMES:
                names.append(os.fsdecode(self.tier.relpath(path)))
        return {"files": files, "bytes": nbytes, "names": names, "error": error or None,
                "local": str(self.tier.tree)}


def _files(top: bytes):
    try:
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            yield top
            return
    except OSError:
        return
    for directory, _, files in os.walk(top):
        for name in files:
            yield os.path.join(directory, name)

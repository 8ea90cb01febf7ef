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

import errno
import os
import stat
import time

from dlfsd.ckpt.beneath import check_relpath
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
        """The directory of `dlfs flush PATH`, relative to ckpt/: a plain relative path
        (no '..', no leading '/') of existing directories, each reached without
        following a link (dlfsd.ckpt.beneath), so a flush never walks outside the tree."""
        if word == "-":
            return None
        under = bytes.fromhex(word)
        shown = os.fsdecode(under)
        try:
            check_relpath(under)
            with self.tier.local.directory(under):
                pass
        except OSError as err:
            why = {errno.EINVAL: "not a plain relative path (no '..', no leading '/')",
                   errno.ELOOP: "a symlink on the way (flush the directory it points to)",
                   errno.ENOTDIR: "not a directory (flush the directory holding it)",
                   errno.ENOENT: "no such directory"}.get(err.errno or 0, err.strerror)
            raise FileNotFoundError(f"cannot flush {shown} in the checkpoint directory: "
                                    f"{why}") from None
        return under

    def pending(self, under: bytes | None, since: int) -> dict:
        rows = {ino: (since_ns, error) for ino, since_ns, _, error in
                self.tier.state.pending_rows() if since_ns <= since}
        files = nbytes = 0
        names: list[str] = []
        error = None
        for directory, entries in self.tier.local.walk(under or b""):
            for name, st in entries:
                row = rows.get(st.st_ino)
                if row is None or not stat.S_ISREG(st.st_mode):
                    continue
                files += 1
                nbytes += st.st_size
                error = error or row[1]
                if len(names) < SAMPLE_NAMES:
                    names.append(os.fsdecode(os.path.join(directory, name)))
        return {"files": files, "bytes": nbytes, "names": names, "error": error or None,
                "local": str(self.tier.tree)}

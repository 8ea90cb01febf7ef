"""errno_for: the one table from an exception raised while serving a FUSE request
to the errno the kernel gets (the worker processes' adapter, dlfsd.fuse.wireworker,
answers with it).

Domain errors carry their errno; an OSError keeps its own (logged once, it
names the file); anything else is a bug, logged with its traceback, and
becomes EIO. No pyfuse3 here.
"""

from __future__ import annotations

import errno
import logging

from dlfs.errors import DlfsError

log = logging.getLogger("dlfsd")


def errno_for(err: Exception, request: str) -> int:
    """The errno to answer `request` with after `err` (logged where the user needs it)."""
    if isinstance(err, DlfsError):
        return err.errno
    if isinstance(err, OSError):
        log.error("%s failed: %s", request, err)
        return err.errno or errno.EIO
    log.error("unexpected error in %s; replying EIO", request, exc_info=err)
    return errno.EIO

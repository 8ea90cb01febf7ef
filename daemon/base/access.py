"""Who a mount is for (`--uid`): the owner its entries show, whether other users get
in, and which datasets a root daemon may serve to that user.

The owner and the admission are plain rules, said once here for both FUSE
connections (the datasets' and the checkpoint directory's). The rest of this
module is the dataset check.

Why: the daemon runs as root (the Slurm prolog mounts for the job's user) and
reads the store as root, so without a check it would show the user every
dataset of the store, also those whose directories the user may not read
(another group's data, a 0700 directory). The user must see through the mount
no more than the store itself shows them.

How: at mount, a forked child drops to the user's uid, gid and supplementary
groups (the kernel then decides, ACLs and all) and, for each dataset, lists
its store directory and opens its manifest. The parent keeps the datasets the
child could read:

- datasets named with `--dataset`: one the user may not read fails the mount
  with one line naming it and what to do (the user asked for it: silently
  leaving it out would surprise the job later);
- the whole store (no `--dataset`): one it may not read is left out, with one
  warning in the daemon's log; none left fails the mount.

Checked once, at mount: permissions changed later take effect at the next
mount. Non-root daemons need no check: they read the store as their user.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
from pathlib import Path

from dlfs.errors import DlfsError
from dlfs.store.format import MANIFEST_NAME

log = logging.getLogger(__name__)


def shown_owner(uid: int | None, gid: int | None) -> tuple[int, int]:
    """The owner (uid, gid) every entry of the mount shows, datasets and ckpt/ alike:
    --uid/--gid (a root daemon mounting for a job's user), else the daemon's own."""
    return (os.getuid() if uid is None else uid), (os.getgid() if gid is None else gid)


def admits_others(allow_other: bool, uid: int | None) -> bool:
    """Whether the kernel lets users other than the mounter in (allow_other): asked
    for, or a root-made mount for one user, whose 0700 root keeps the others out."""
    return allow_other or uid is not None


def served_to_user(names: list[str], store: Path, uid: int | None, gid: int | None,
                   explicit: bool) -> list[str]:
    """The datasets of `names` (in `store`) to serve: all of them unless this daemon is
    root mounting for user `uid` (`gid`: the mount's group, None for the user's own),
    then those that user may read (see the module doc for what happens to the rest)."""
    if uid is None or uid == 0 or os.geteuid() != 0:
        return names
    user, groups = _identity(uid, gid)
    problems = unreadable_as(uid, groups[0], groups, [store / name for name in names])
    if not problems:
        return names
    who = f"user {user} (uid {uid})"
    denied = [name for name in names if str(store / name) in problems]
    if explicit:
        why = "; ".join(f"{store / n}: {problems[str(store / n)]}" for n in denied)
        listed = ", ".join(repr(n) for n in denied)
        raise DlfsError(f"{who} may not read dataset{'s' if len(denied) > 1 else ''} "
                        f"{listed} in store {store} ({why}): grant the user read access to "
                        "the dataset's directory, or leave it out of --dataset")
    for name in denied:
        log.warning("dataset %r not served: %s may not read %s (%s); grant the user read "
                    "access to serve it", name, who, store / name, problems[str(store / name)])
    kept = [name for name in names if name not in denied]
    if not kept:
        raise DlfsError(f"{who} may read none of the datasets in store {store} "
                        f"(e.g. {store / denied[0]}: {problems[str(store / denied[0])]}): "
                        "grant the user read access to the datasets it should see")
    return kept


def _identity(uid: int, gid: int | None) -> tuple[str, list[int]]:
    """The user's name and groups: the mount's gid (else the user's primary group)
    first, then the user's supplementary groups (none for a uid without an entry)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return str(uid), [gid if gid is not None else uid]
    primary = gid if gid is not None else entry.pw_gid
    groups = [primary, *(g for g in os.getgrouplist(entry.pw_name, entry.pw_gid)
                         if g != primary)]
    return entry.pw_name, groups


def unreadable_as(uid: int, gid: int, groups: list[int], dirs: list[Path]) -> dict[str, str]:
    """{directory: why} for each of `dirs` that uid/gid/groups may not list, or whose
    manifest they may not open. Checked in a forked child that drops to those ids (a
    root daemon's own thread cannot change credentials for itself alone)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, only system calls and os._exit
        code = 1
        try:
            os.close(read)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            answer = {}
            for path in dirs:
                try:
                    os.listdir(path)
                    os.close(os.open(path / MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC))
                except OSError as err:
                    answer[str(path)] = err.strerror or str(err)
            data = json.dumps(answer).encode()
            while data:
                data = data[os.write(write, data):]
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    with contextlib.closing(os.fdopen(read, "rb")) as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise DlfsError(f"cannot check which datasets uid {uid} may read (the check as that "
                        "user failed); see the daemon's log")
    return json.loads(b"".join(chunks))

"""The datasets' FUSE session: mount, answer INIT, unmount. Nothing else.

The main process mounts the datasets' connection and answers the kernel's INIT here,
with dlfsd.fuse.rawsession (as the checkpoint directory's connection does): one way
to set a connection up. Every request after INIT is served by the forked worker
processes, which speak the kernel protocol themselves (dlfsd.fuse.wireworker).

Why not libfuse (through pyfuse3), which did this until issue 32: INIT decides what
the kernel does with the whole connection, and libfuse answered it with its own
defaults. Through pyfuse3 DLFS could add a few capabilities and clear none, so a
read-only mount carried ATOMIC_O_TRUNC and could not ask for a request timeout (Linux
>= 6.14), which libfuse 3.14 does not know. Mounting was all libfuse still did, the
same two ways rawsession already mounts the checkpoint directory (mount(2) as root,
fusermount3 otherwise); so the daemon no longer imports pyfuse3 at all.
"""

from __future__ import annotations

import logging
import os

from dlfs.errors import DlfsError
from dlfsd.fuse.rawsession import Negotiated, RawSession, Wants, dataset_wants

log = logging.getLogger(__name__)

# The options the daemon's mount_options() may name; "debug" asked libfuse to log
# requests, which the workers do themselves under --debug.
_FLAG_OPTIONS = {"ro", "allow_other", "default_permissions", "noatime", "debug"}

_session: RawSession | None = None
_wants: Wants | None = None


def mount(mountpoint: str, options: set[str]) -> None:
    """Mount `mountpoint` (the kernel then sends INIT; answer it with answer_init).

    `options`: fsname=dlfs, subtype=dlfs, ro, allow_other, default_permissions, noatime
    (the daemon's mount_options); anything else is a programming error."""
    global _session
    named = dict(option.split("=", 1) for option in options if "=" in option)
    unknown = ({o for o in options if "=" not in o} - _FLAG_OPTIONS) | {
        f"{k}={v}" for k, v in named.items() if (k, v) != ("fsname", "dlfs") and k != "subtype"}
    if unknown:
        raise ValueError(f"unsupported mount options: {', '.join(sorted(unknown))}")
    session = RawSession(mountpoint, os.getuid(), os.getgid(), "allow_other" in options,
                         subtype=named.get("subtype", "dlfs"), read_only="ro" in options)
    session.mount()
    _session = session


def answer_init(timeout: float, request_timeout: int, passthrough: bool = False) -> Negotiated:
    """Serve the kernel's INIT request within `timeout` seconds, asking for what a
    read-only dataset mount wants (rawsession.dataset_wants) and a request timeout of
    `request_timeout` seconds (0: none), and FUSE passthrough if `passthrough`; logs what
    the kernel granted, once.

    The workers may only be forked after this (they take the negotiated session
    over), and INIT sets the mount's read-ahead, which the daemon raises afterwards.
    """
    global _wants
    if _session is None:
        raise RuntimeError("answer_init before mount")
    _wants = dataset_wants(request_timeout, passthrough)
    try:
        negotiated = _session.serve_init(timeout, _wants)
    except (OSError, TimeoutError) as err:
        raise DlfsError(f"cannot start the FUSE connection of {_session.mountpoint}: "
                        f"{err}") from None
    log.info("FUSE connection %s: %s", _session.mountpoint, negotiated.describe(_wants))
    return negotiated


def report(negotiated: Negotiated) -> dict:
    """What INIT granted, for the status file (`dlfs status`)."""
    return negotiated.report(_wants or dataset_wants(0))


def close(unmount: bool) -> None:
    """End the session; `unmount`: also unmount (False: the kernel already did)."""
    global _session
    if _session is None:
        return
    session, _session = _session, None
    if unmount:
        session.unmount()
    else:
        session.close()

"""The FUSE session through pyfuse3 (libfuse): mount, answer INIT, unmount. Nothing else.

libfuse mounts (through fusermount3 when not root) and negotiates the protocol
with the kernel (INIT: protocol version, capabilities, maximum sizes). Every
request after INIT is served by the forked worker processes, which speak the
kernel protocol themselves (dlfsd.fuse.wireworker); pyfuse3 never sees one.
So the Operations class here answers INIT and stops pyfuse3's loop right there,
before it could read a request meant for the workers (a request it read would
get pyfuse3's default answer, ENOSYS, which the kernel takes for some requests
as "never ask again").
"""

from __future__ import annotations

import pyfuse3
import trio


class _InitOnly(pyfuse3.Operations):
    """Answers INIT (libfuse sends the reply after `init` returns), then ends the loop."""

    def init(self) -> None:
        pyfuse3.terminate()  # the session's exit flag: pyfuse3.main reads no further request


def mount(mountpoint: str, options: set[str]) -> None:
    """Mount `mountpoint` (the kernel then sends INIT; answer it with answer_init)."""
    pyfuse3.init(_InitOnly(), mountpoint, options)


def answer_init(timeout: float) -> None:
    """Serve the kernel's INIT request, within `timeout` seconds (trio.TooSlowError).

    The workers may only be forked after this (they take the negotiated session
    over), and INIT sets the mount's read-ahead, which the daemon raises afterwards.
    """

    async def serve() -> None:
        with trio.fail_after(timeout):
            await pyfuse3.main(1, 1)

    trio.run(serve)


def close(unmount: bool) -> None:
    """End the session; `unmount`: also unmount (False: the kernel already did)."""
    pyfuse3.close(unmount=unmount)

"""Large receive and copy buffers that cost memory only where they are written.

Why: a buffer must hold the largest extent (4 MiB), but a sample is ~110 KiB. A
`bytearray(n)` writes its n zero bytes at once, so each one put 4 MiB into the
process's RSS and cost ~1,000 page faults when it was made: every worker's peer
client, each of the look-ahead's fetch threads (up to 32: 128 MiB in the control
process) and the peer server's loops. A private anonymous mapping is zero too,
but the kernel gives it pages only as they are first written: a buffer that has
only ever held 110 KiB samples costs 28 pages. Private: a process forked after
it was made gets its own copy on write, never the parent's bytes.
"""

from __future__ import annotations

import mmap


def lazy_buffer(size: int) -> memoryview:
    """A writable zeroed buffer of `size` bytes whose pages come on first write."""
    return memoryview(mmap.mmap(-1, max(1, size), flags=mmap.MAP_PRIVATE))

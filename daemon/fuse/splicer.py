"""ReplySplicer: answer a FUSE READ with bytes spliced from a chunk file.

Why: a worker answering a large read with pread() + writev() copies every
byte twice in the kernel (chunk page cache -> our buffer -> the request's
pages) and allocates the buffer. splice(2) moves references to the chunk
file's cached pages into a pipe, and the FUSE device copies them from the
pipe straight into the request: one copy, no buffer. The reply is written
into the pipe as header (16 bytes, written) + data (spliced from the file),
then spliced from the pipe into /dev/fuse in one go, which the device needs:
a reply must arrive whole.

Only 1 MiB reads are spliced (smaller ones measured faster copied, see
dlfsd.core.reader.SPAN_MIN), and the pipe must hold a whole reply: 1 MiB plus a
header, 258 pages at worst, so the pipe is made dlfs.pipes.PIPE_BYTES, which needs
CAP_SYS_RESOURCE or fs.pipe-max-size >= 2 MiB; without either, nothing is
spliced. Replies that do not fit, and everything after a file system refuses
splice, go the copying way. If anything fails half-way the pipe is replaced,
so no stale bytes can start the next reply.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")


class SpliceFailed(Exception):
    """The reply was not sent; the caller should answer the copying way."""


class ReplySplicer:
    """One pipe per worker process; `send` answers one request at a time."""

    def __init__(self, fuse_fd: int, pipe_size: int) -> None:
        self.fuse_fd = fuse_fd
        self.capacity = 0  # bytes of payload a reply surely fits; 0: splicing is off
        self._pipe_size = pipe_size
        self._read_end = self._write_end = -1
        self._slots = 0
        if pipe_size:
            self._open_pipe()

    def _open_pipe(self) -> None:
        self._read_end, self._write_end = os.pipe2(os.O_CLOEXEC)
        try:
            size = fcntl.fcntl(self._write_end, fcntl.F_SETPIPE_SZ, self._pipe_size)
        except OSError as err:
            log.warning("cannot size the reply pipe (%s); read replies are copied", err)
            self.close()
            return
        self._slots = size // _PAGE
        # Bytes a reply surely fits: the header takes a slot, and unaligned data
        # one more than its length in pages.
        self.capacity = max(0, size - 2 * _PAGE)
        if not self.capacity:
            self.close()

    def fits(self, pos: int, length: int) -> bool:
        """Whether the pipe holds the header plus `length` bytes from file offset `pos`
        (a pipe slot holds at most one page of the file)."""
        return 1 + (pos % _PAGE + length + _PAGE - 1) // _PAGE <= self._slots

    def send(self, header: bytes, fd: int, pos: int, length: int) -> None:
        """Send `header` then `length` bytes of `fd` at `pos` as one FUSE reply.

        Raises SpliceFailed (nothing was sent; answer otherwise). A request the
        kernel dropped meanwhile (ENOENT) counts as answered, as with write().
        """
        if not self.fits(pos, length):
            raise SpliceFailed(f"{length} bytes do not fit the reply pipe")
        try:
            os.write(self._write_end, header)
            left, at = length, pos
            while left:
                # NONBLOCK: a full pipe (it cannot be, see fits) must fail, not hang us.
                moved = os.splice(fd, self._write_end, left, offset_src=at,
                                  flags=os.SPLICE_F_NONBLOCK)
                if moved == 0:  # the file ends early (truncated): not the bytes we promised
                    raise SpliceFailed(f"chunk file ends before offset {at + left}")
                left -= moved
                at += moved
        except OSError as err:
            if err.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                log.info("the chunk file system cannot splice (%s); large reads are copied",
                         err)
                self.close()
            else:
                self._reset()
            raise SpliceFailed(str(err)) from None
        except SpliceFailed:
            self._reset()
            raise
        total = len(header) + length
        try:
            sent = os.splice(self._read_end, self.fuse_fd, total)
        except OSError as err:
            self._reset()
            if err.errno in (errno.ENOENT, errno.ENODEV):  # interrupted, or unmounted
                return
            raise SpliceFailed(str(err)) from None
        if sent != total:  # cannot happen for a whole reply; never leave leftovers
            self._reset()
            raise SpliceFailed(f"the FUSE device took {sent} of {total} bytes")

    def _reset(self) -> None:
        """Drop the pipe with whatever half a reply is in it; start a fresh one."""
        self._close_pipe()
        if self.capacity:
            self._open_pipe()

    def close(self) -> None:
        """Splice no more (capacity 0) and release the pipe."""
        self.capacity = 0
        self._close_pipe()

    def _close_pipe(self) -> None:
        for fd in (self._read_end, self._write_end):
            if fd >= 0:
                os.close(fd)
        self._read_end = self._write_end = -1

"""Error types shared by the core, the CLI and the daemon.

User-facing failures are `DlfsError`s: their message is one line that says what
went wrong, on which path, and what to do. The CLI prints it and exits with
`exit_code`; the daemon maps the `errno` attribute onto the FUSE reply.
"""

from __future__ import annotations

import errno as _errno

# Exit codes of every `dlfs` subcommand (documented in `dlfs --help`).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
# `dlfs ckpt-audit`: a checkpoint tier the epilog must keep, and why.
EXIT_CKPT_UNDRAINED = 4
EXIT_CKPT_IN_USE = 5
EXIT_CKPT_UNKNOWN = 6
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, what a shell shows for a tool its pipe ended


class DlfsError(Exception):
    """A failure a user can act on; str(err) is the one-line message."""

    exit_code = EXIT_ERROR
    errno = _errno.EIO


class UsageError(DlfsError):
    """Bad command-line input (a flag value, a dataset name)."""

    exit_code = EXIT_USAGE
    errno = _errno.EINVAL


class NotFoundError(DlfsError):
    """A named thing (dataset, source, mountpoint, path) does not exist."""

    errno = _errno.ENOENT


class FormatError(DlfsError):
    """A manifest or chunk file is not in a format this version understands."""

    errno = _errno.EIO


class FormatVersionError(FormatError):
    """Written by another dlfs version: not damage (verify must not call it corrupt)."""


class CorruptDataError(DlfsError):
    """Bytes on disk do not match their recorded checksum."""

    exit_code = EXIT_CORRUPT
    errno = _errno.EIO


class ReadOnlyError(DlfsError):
    """Datasets are immutable: any modification through the mount."""

    errno = _errno.EROFS


class NoAttributeError(DlfsError):
    """No such extended attribute (getxattr)."""

    errno = _errno.ENODATA


class NotADirError(DlfsError):
    """A path component or opendir target is not a directory."""

    errno = _errno.ENOTDIR


class IsADirError(DlfsError):
    """A file operation was asked of a directory."""

    errno = _errno.EISDIR


class ReportedElsewhere(DlfsError):
    """An MPI rank's view of a failure that rank 0 reports, so the user reads it once."""


class NotMountedError(DlfsError):
    """`dlfs umount` of a path where no DLFS (and no other file system) is mounted."""

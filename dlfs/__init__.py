"""DLFS core library: store format, sample directory, populate and admin CLI.

This package must import without libfuse/pyfuse3 so that `dlfs populate` runs
on login nodes and inside MPI ranks; the FUSE daemon lives in `dlfsd`.
"""

__version__ = "0.1.0"

"""dlfsd: the per-node DLFS daemon (FUSE ops, sample reader, lifecycle).

Only `dlfsd.fuse.ops` and `dlfsd.main` import pyfuse3; the namespace and the reader
are plain trio code that tests drive directly.
"""

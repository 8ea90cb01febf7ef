"""dlfsd: the per-node DLFS daemon (FUSE adapter, sample reader, lifecycle).

Only `dlfsd.fuse.session` (mount and INIT) and `dlfsd.main` import pyfuse3; the
namespace and the reader are plain blocking code that tests drive directly.
"""

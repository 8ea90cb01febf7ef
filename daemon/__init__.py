"""dlfsd: the per-node DLFS daemon (FUSE adapter, sample reader, lifecycle).

No libfuse binding: `dlfsd.fuse.session` mounts and answers INIT itself
(dlfsd.fuse.rawsession); the namespace and the reader are plain blocking code that
tests drive directly.
"""

# The daemon's own release, written here and not taken from dlfs.__version__: a
# daemon reports the code it runs, which on a node with a mixed install is not the
# launcher's (dlfs.launch.version_refusal). tests/test_version.py keeps both equal.
__version__ = "0.1.0"

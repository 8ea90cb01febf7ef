"""dlfsd: the per-node DLFS daemon.

Its folders are its layers, lowest first (tests/test_layering.py): `base` (what
every part uses), `obs` (what it reports), `pool` (staged copies, stager, peers),
`core` (namespace and reader, plain blocking code that tests drive directly),
`ckpt` (the checkpoint tier), `fuse` (the adapters: it mounts and answers INIT
itself, no libfuse binding). The modules here are the start-up above them all:
`python -m dlfsd` (main), assembling the parts (assemble), the checkpoint
connection (ckptconnect), the workers' watch (supervise), the services, the
launcher's commit.
"""

# The daemon's own release, written here and not taken from dlfs.__version__: a
# daemon reports the code it runs, which on a node with a mixed install is not the
# launcher's (dlfs.launch.version_refusal). tests/test_version.py keeps both equal.
__version__ = "0.1.0"

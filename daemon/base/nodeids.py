"""Node ids of the checkpoint subtree: CKPT_BIT | st_ino of the backing entry.

The top bit keeps them apart from the mount root, `.dlfs/` and dataset inodes (all
far below 2**63): the read path tells a checkpoint node from a dataset one with one
comparison. Here, without imports, because the namespace and the FUSE adapters
need them and the tree itself sits above the namespace.
"""

CKPT_BIT = 1 << 63
CKPT_NAME = b"ckpt"  # its name in the mount root

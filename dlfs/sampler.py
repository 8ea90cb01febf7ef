"""The public name of the sampler: `from dlfs.sampler import DLFSSampler`.

The sampler lives in dlfs.order.sampler with the plans it follows; this module
only re-exports its public names (tests/test_layering.py allows nothing else
here).
"""

from dlfs.order.sampler import (
    DLFSSampler,
    Locality,
    OrderClient,
    dataset_paths,
    dlfs_mount_of,
    write_order,
)

__all__ = ["DLFSSampler", "Locality", "OrderClient", "dataset_paths", "dlfs_mount_of",
           "write_order"]

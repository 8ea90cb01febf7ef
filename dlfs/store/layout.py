"""Where each file's bytes go: cutting files into extents and packing them into chunks.

Pure arithmetic over file sizes, so every MPI rank (or a test) computes the same
plan without touching data. An extent never straddles two chunks; files larger
than `extent_size` are cut into `extent_size` pieces (only the last may be
shorter), so file offset -> extent is a division, not a search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlfs.store.format import MAX_EXTENT_SIZE


@dataclass(frozen=True)
class ExtentPlan:
    """Extents of all files, in file order."""

    ext_start: np.ndarray  # uint32[n_files + 1]: extents of file i are ext_start[i]:ext_start[i+1]
    ext_chunk: np.ndarray  # uint32[n_extents]
    ext_offset: np.ndarray  # uint32[n_extents]: offset in the chunk's data area
    ext_length: np.ndarray  # uint32[n_extents]
    extent_size: int


def extent_size_for(chunk_size: int) -> int:
    """The piece size large files are cut into: at most one chunk, at most 4 MiB."""
    return min(MAX_EXTENT_SIZE, chunk_size)


def plan_extents(file_sizes: np.ndarray | list[int], chunk_size: int) -> ExtentPlan:
    """Pack files back to back; start a new chunk when the next extent does not fit."""
    sizes = np.asarray(file_sizes, dtype=np.uint64)
    piece = extent_size_for(chunk_size)
    counts = (sizes + np.uint64(piece - 1)) // np.uint64(piece)
    ext_start = np.zeros(len(sizes) + 1, dtype=np.uint32)
    np.cumsum(counts, out=ext_start[1:])
    n_ext = int(ext_start[-1])

    # Length of every extent: full pieces, then the remainder of each file.
    lengths = np.full(n_ext, piece, dtype=np.uint32)
    last = ext_start[1:][counts > 0] - 1
    tail = sizes[counts > 0] - (counts[counts > 0] - np.uint64(1)) * np.uint64(piece)
    lengths[last] = tail.astype(np.uint32)

    chunks = np.empty(n_ext, dtype=np.uint32)
    offsets = np.empty(n_ext, dtype=np.uint32)
    chunk, pos = 0, 0
    for i, length in enumerate(lengths.tolist()):
        if pos + length > chunk_size and pos > 0:
            chunk, pos = chunk + 1, 0
        chunks[i] = chunk
        offsets[i] = pos
        pos += length
    return ExtentPlan(
        ext_start=ext_start,
        ext_chunk=chunks,
        ext_offset=offsets,
        ext_length=lengths,
        extent_size=piece,
    )

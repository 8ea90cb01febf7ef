"""`dlfs verify`: re-read every chunk of a dataset and check every checksum.

Names each file whose bytes are corrupt, so an admin knows exactly what to
re-populate. Chunks are checked in parallel (stores are parallel file systems).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from dlfs.errors import FormatError
from dlfs.progress import byte_progress
from dlfs.store.format import CHUNK_HEADER_SIZE, check_chunk_header, checksum
from dlfs.store.store import Dataset


@dataclass
class VerifyReport:
    checked_bytes: int = 0
    corrupt_files: list[bytes] = field(default_factory=list)
    chunk_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.corrupt_files and not self.chunk_errors


def _check_chunk(dataset: Dataset, index: int, extents: range) -> tuple[list[int], str | None]:
    """Bad extent ids of one chunk, plus a chunk-level error (missing, truncated, header)."""
    path = dataset.chunk_path(index)
    try:
        with open(path, "rb") as f:
            recorded = check_chunk_header(f.read(CHUNK_HEADER_SIZE), path, index, dataset.uuid)
            data = f.read(int(dataset.chunk_lengths[index]))
    except (OSError, FormatError) as err:
        return list(extents), f"chunk {index}: {err}"
    error = None
    if recorded != dataset.chunk_lengths[index]:  # staging and peers refuse such a copy
        error = (f"chunk {index}: header records {recorded} data bytes, the manifest "
                 f"{int(dataset.chunk_lengths[index])}: {path}")
    view = memoryview(data)
    directory = dataset.directory
    bad = []
    for ext in extents:
        start = directory.ext_offset_view[ext]
        piece = view[start : start + directory.ext_length_view[ext]]
        if len(piece) != directory.ext_length_view[ext] or \
                checksum(piece) != directory.ext_checksum_view[ext]:
            bad.append(ext)
    return bad, error


def verify_dataset(dataset: Dataset, jobs: int = 4, progress: bool | None = None) -> VerifyReport:
    """Check every extent of every chunk; collect the paths of corrupt files."""
    report = VerifyReport()
    ext_chunk = dataset.directory.arrays["ext_chunk"]
    bounds = np.searchsorted(ext_chunk, np.arange(dataset.chunk_count + 1))
    bad_extents: list[int] = []
    total = int(dataset.chunk_lengths.sum())
    with ThreadPoolExecutor(max(1, jobs)) as pool, \
            byte_progress(f"verifying {dataset.name}", total, progress) as advance:
        futures = [pool.submit(_check_chunk, dataset, i, range(bounds[i], bounds[i + 1]))
                   for i in range(dataset.chunk_count)]
        try:
            for i, future in enumerate(futures):
                bad, error = future.result()
                bad_extents.extend(bad)
                if error:
                    report.chunk_errors.append(error)
                report.checked_bytes += int(dataset.chunk_lengths[i])
                advance(int(dataset.chunk_lengths[i]))
        except BaseException:  # Ctrl-C: stop after the chunks being read, not all of them
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    rows = sorted({dataset.directory.row_of_extent(e) for e in bad_extents})
    report.corrupt_files = [dataset.directory.path(r) for r in rows]
    return report

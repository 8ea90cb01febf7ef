"""On-disk format of a packed dataset (see docs/FORMAT.md).

A dataset directory in the store holds `manifest.dlfs` (the sample directory
plus metadata) and `chunks/NNNNNNNN.chunk` files. Both carry a magic and a
format version so a reader of another version fails with a clear message
instead of misreading bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import xxhash

from dlfs.errors import FormatError, FormatVersionError

CHUNK_MAGIC = b"DLFSCHNK"
CHUNK_FORMAT_VERSION = 1
# Data starts one page in, so extent offsets stay page-aligned relative to the file.
CHUNK_HEADER_SIZE = 4096
# magic, version, chunk index, data length, dataset uuid
_CHUNK_HEADER = struct.Struct("<8sIIQ16s")

MANIFEST_MAGIC = b"DLFSMANI"
MANIFEST_FORMAT_VERSION = 1
# magic, version, xxh3-64 of the msgpack body
_MANIFEST_HEADER = struct.Struct("<8sIQ")

MANIFEST_NAME = "manifest.dlfs"
CHUNK_DIR = "chunks"

DEFAULT_CHUNK_SIZE = 64 << 20
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 2 << 30
# Large files are cut into pieces of at most this size, each with its own
# checksum, so a read deep inside a big file verifies only the piece it touches.
MAX_EXTENT_SIZE = 4 << 20


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum of one extent: xxh3-64 (fast enough to verify on read)."""
    return xxhash.xxh3_64_intdigest(data)


def chunk_filename(index: int) -> str:
    return f"{index:08d}.chunk"


def chunk_path(dataset_dir: Path, index: int) -> Path:
    return dataset_dir / CHUNK_DIR / chunk_filename(index)


def pack_chunk_header(index: int, data_length: int, dataset_uuid: bytes) -> bytes:
    """The fixed-size header written at the start of every chunk file."""
    head = _CHUNK_HEADER.pack(CHUNK_MAGIC, CHUNK_FORMAT_VERSION, index, data_length, dataset_uuid)
    return head.ljust(CHUNK_HEADER_SIZE, b"\0")


def check_chunk_header(raw: bytes, path: Path, index: int, dataset_uuid: bytes) -> int:
    """Validate a chunk header; return the data length it records."""
    if len(raw) < _CHUNK_HEADER.size:
        raise FormatError(f"chunk file truncated (no header): {path}")
    magic, version, got_index, length, got_uuid = _CHUNK_HEADER.unpack_from(raw)
    if magic != CHUNK_MAGIC:
        raise FormatError(f"not a DLFS chunk file (bad magic): {path}")
    if version != CHUNK_FORMAT_VERSION:
        raise FormatVersionError(
            f"chunk format version {version} is not supported (this dlfs reads "
            f"{CHUNK_FORMAT_VERSION}): {path}; upgrade dlfs or re-populate"
        )
    if got_index != index or got_uuid != dataset_uuid:
        raise FormatError(f"chunk file belongs to another dataset or slot: {path}")
    return length


def encode_manifest(body: dict) -> bytes:
    """Serialize the manifest body with a header holding magic, version and checksum."""
    packed = msgpack.packb(body, use_bin_type=True)
    return _MANIFEST_HEADER.pack(MANIFEST_MAGIC, MANIFEST_FORMAT_VERSION, checksum(packed)) + packed


def decode_manifest(raw: bytes, path: Path) -> dict:
    """Parse and check a manifest; raise FormatError with the path on any problem."""
    if len(raw) < _MANIFEST_HEADER.size:
        raise FormatError(f"manifest truncated: {path}")
    magic, version, digest = _MANIFEST_HEADER.unpack_from(raw)
    if magic != MANIFEST_MAGIC:
        raise FormatError(f"not a DLFS manifest (bad magic): {path}")
    if version != MANIFEST_FORMAT_VERSION:
        raise FormatVersionError(
            f"manifest format version {version} is not supported (this dlfs reads "
            f"{MANIFEST_FORMAT_VERSION}): {path}; upgrade dlfs or re-populate"
        )
    body = memoryview(raw)[_MANIFEST_HEADER.size :]
    if checksum(body) != digest:
        raise FormatError(f"manifest is corrupt (checksum mismatch): {path}; re-populate")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as err:
        raise FormatError(f"manifest is unreadable ({err}): {path}") from err

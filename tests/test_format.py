"""Unit tests of the on-disk format: headers, manifests, extent planning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfs.errors import FormatError
from dlfs.store.format import (
    CHUNK_HEADER_SIZE,
    MANIFEST_FORMAT_VERSION,
    check_chunk_header,
    decode_manifest,
    encode_manifest,
    pack_chunk_header,
)
from dlfs.store.layout import plan_extents

UUID = bytes(range(16))


def test_chunk_header_round_trip(tmp_path):
    raw = pack_chunk_header(7, 12345, UUID)
    assert len(raw) == CHUNK_HEADER_SIZE
    assert check_chunk_header(raw, tmp_path, 7, UUID) == 12345


@pytest.mark.parametrize("index, uuid", [(8, UUID), (7, bytes(16))])
def test_chunk_header_rejects_wrong_slot_or_dataset(tmp_path, index, uuid):
    raw = pack_chunk_header(7, 1, UUID)
    with pytest.raises(FormatError, match="another dataset"):
        check_chunk_header(raw, tmp_path, index, uuid)


def test_chunk_header_rejects_unknown_version(tmp_path):
    raw = bytearray(pack_chunk_header(0, 1, UUID))
    raw[8] = 99  # version field follows the 8-byte magic
    with pytest.raises(FormatError, match="version 99 is not supported"):
        check_chunk_header(bytes(raw), tmp_path, 0, UUID)


def test_chunk_header_rejects_bad_magic(tmp_path):
    with pytest.raises(FormatError, match="bad magic"):
        check_chunk_header(b"X" * CHUNK_HEADER_SIZE, tmp_path, 0, UUID)


def test_manifest_round_trip(tmp_path):
    body = {"name": "x", "blob": b"\xff\x00", "n": [1, 2, 3], "k": {"a": 1.5}}
    assert decode_manifest(encode_manifest(body), tmp_path) == body


def test_manifest_detects_flipped_byte(tmp_path):
    raw = bytearray(encode_manifest({"name": "x", "data": b"0123456789"}))
    raw[-3] ^= 0x01
    with pytest.raises(FormatError, match="corrupt"):
        decode_manifest(bytes(raw), tmp_path)


def test_manifest_rejects_future_version(tmp_path):
    raw = bytearray(encode_manifest({}))
    raw[8] = MANIFEST_FORMAT_VERSION + 1
    with pytest.raises(FormatError, match="not supported"):
        decode_manifest(bytes(raw), tmp_path)


@given(sizes=st.lists(st.integers(0, 50_000), max_size=60),
       chunk_size=st.sampled_from([4096, 10_000, 65_536]))
def test_plan_places_every_byte_once_within_chunks(sizes, chunk_size):
    plan = plan_extents(sizes, chunk_size)
    piece = plan.extent_size
    assert piece == min(chunk_size, 4 << 20)
    for i, size in enumerate(sizes):
        exts = range(plan.ext_start[i], plan.ext_start[i + 1])
        assert sum(int(plan.ext_length[e]) for e in exts) == size
        # every extent but the last is a full piece: offset -> extent is a division
        assert all(plan.ext_length[e] == piece for e in list(exts)[:-1])
    ends = plan.ext_offset.astype(np.int64) + plan.ext_length
    assert (ends <= chunk_size).all()
    # extents are packed back to back in order, never overlapping
    order = np.lexsort((plan.ext_offset, plan.ext_chunk))
    assert (order == np.arange(len(order))).all()
    same_chunk = plan.ext_chunk[1:] == plan.ext_chunk[:-1]
    assert (plan.ext_offset[1:][same_chunk] == ends[:-1][same_chunk]).all()
    assert (plan.ext_offset[1:][~same_chunk] == 0).all()


def test_plan_exact_chunk_boundary():
    plan = plan_extents([4096, 4096, 1], 4096)
    assert plan.ext_chunk.tolist() == [0, 1, 2]
    assert plan.ext_offset.tolist() == [0, 0, 0]


def test_plan_empty_files_have_no_extents():
    plan = plan_extents([0, 5, 0], 4096)
    assert plan.ext_start.tolist() == [0, 0, 1, 1]

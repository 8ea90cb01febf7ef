"""dlfsd.pool.protocol: frames and messages, including whatever a hostile peer might send."""

from __future__ import annotations

import secrets
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlfs.errors import DlfsError
from dlfsd.pool import protocol
from dlfsd.pool.protocol import FrameDecoder, ProtocolError

NONCE = bytes(range(32))
DATASET = bytes(range(16))

EVERY_MESSAGE = [
    protocol.hello("node-01.cluster", NONCE),
    protocol.hello("nœud-ünicode", NONCE, version=7),
    protocol.challenge(NONCE, b"p" * 32),
    protocol.auth(b"q" * 32),
    protocol.ok(),
    protocol.err(protocol.ERR_AUTH, "authentication failed"),
    protocol.read(0, DATASET, 0, 0, 1),
    protocol.read(protocol.MAX_REQUEST_ID, DATASET, 2**32, 2**63, 0),
    protocol.data(5, b""),
    protocol.data(6, b"\x00\xff" * 1000),
    protocol.data(7, b"x" * protocol.MAX_READ),
    protocol.miss(8),
    protocol.fail(9, protocol.FAIL_OUT_OF_RANGE),
    {"t": protocol.REPORT, "n": 1, "ds": DATASET, "chunk": 3, "off": 4096, "len": 100,
     "proof": b"r" * 32},
]


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def decode_all(data: bytes, max_frame: int = protocol.MAX_FRAME) -> list[dict]:
    return FrameDecoder(max_frame).feed(data)


def test_protocol_error_is_a_dlfs_error():
    assert issubclass(ProtocolError, DlfsError)


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: m["t"])
def test_every_message_round_trips(msg):
    assert decode_all(protocol.encode(msg)) == [msg]


def test_many_frames_in_one_feed_and_one_byte_at_a_time_decode_identically():
    stream = b"".join(protocol.encode(m) for m in EVERY_MESSAGE if m["t"] != "data")
    whole = decode_all(stream)
    decoder = FrameDecoder()
    trickled = []
    for i in range(len(stream)):
        trickled += decoder.feed(stream[i:i + 1])
    assert whole == trickled == [m for m in EVERY_MESSAGE if m["t"] != "data"]
    assert decoder.buffered == 0


def test_split_feeds_of_a_large_data_frame():
    msg = protocol.data(3, bytes(range(256)) * 8192)
    encoded = protocol.encode(msg)
    decoder = FrameDecoder()
    out = []
    for start in range(0, len(encoded), 65536):
        out += decoder.feed(encoded[start:start + 65536])
    assert out == [msg]


def test_oversized_length_prefix_is_rejected_before_the_body_arrives():
    decoder = FrameDecoder(max_frame=1000)
    assert decoder.feed(struct.pack(">I", 1000)[:3]) == []
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.feed(b"\xe9")  # completes the prefix 0x3e9 = 1001; no body sent
    assert decoder.buffered == 0
    with pytest.raises(ProtocolError):  # a broken decoder stays broken
        decoder.feed(protocol.encode(protocol.ok()))


def test_default_limit_admits_the_largest_data_reply_and_nothing_far_beyond():
    assert len(protocol.encode(protocol.data(protocol.MAX_REQUEST_ID,
                                             b"x" * protocol.MAX_READ))) <= protocol.MAX_FRAME + 4
    with pytest.raises(ProtocolError):
        decode_all(struct.pack(">I", protocol.MAX_FRAME + 1))
    with pytest.raises(ProtocolError):
        decode_all(struct.pack(">I", 2**32 - 1))


@pytest.mark.parametrize("body", [
    msgpack.packb([1, 2, 3]),                               # not a map
    msgpack.packb("hello"),
    b"\xc1",                                                # never-used msgpack byte
    b"",                                                    # empty body
    msgpack.packb({"t": "bogus"}),                          # unknown type
    msgpack.packb({"x": 1}),                                # no type
    msgpack.packb({"t": 1}),
    msgpack.packb({"t": "ok"}) + b"\x00",                   # trailing junk
    msgpack.packb({"t": "ok", "extra": 1}),                 # extra field
    msgpack.packb({"t": "miss"}),                           # missing field
    msgpack.packb({"t": "miss", "id": -1}),                 # negative id
    msgpack.packb({"t": "miss", "id": 2**32}),              # id beyond uint32
    msgpack.packb({"t": "miss", "id": True}),               # bool is not an int
    msgpack.packb({"t": "miss", "id": 1.0}),
    msgpack.packb({"t": "auth", "proof": b"x" * 31}),       # wrong proof size
    msgpack.packb({"t": "auth", "proof": "x" * 32}),        # str, not bin
    msgpack.packb({"t": "hello", "v": 1, "node": "n", "nonce": b"x" * 33}),
    msgpack.packb({"t": "hello", "v": 1, "node": "n" * 256, "nonce": NONCE}),
    msgpack.packb({"t": "read", "id": 1, "ds": b"x" * 15, "chunk": 0, "off": 0, "len": 1}),
    msgpack.packb({"t": "read", "id": 1, "ds": DATASET, "chunk": -1, "off": 0, "len": 1}),
    msgpack.packb({"t": "data", "id": 1, "data": b"x" * (protocol.MAX_READ + 1)}),
    msgpack.packb({1: 2}),                                  # non-string key
    msgpack.packb({"t": "ok"}, use_bin_type=True).replace(b"\xa1t", b"\xa1\xff"),  # bad UTF-8
    b"\x91" * 5000,                                         # deep nesting
    b"\xd4\x01\x00",                                        # ext type
    b"\xdb\xff\xff\xff\xff",                                # str claiming 4 GiB
    b"\xdd\xff\xff\xff\xff",                                # array claiming 4 G items
])
def test_malformed_bodies_raise_protocol_error(body):
    with pytest.raises(ProtocolError):
        decode_all(frame(body))


def test_encode_refuses_malformed_messages():
    with pytest.raises(ProtocolError):
        protocol.encode({"t": "read", "id": 1})
    with pytest.raises(ProtocolError):
        protocol.encode(protocol.data(1, b"x" * (protocol.MAX_READ + 1)))


def test_handshake_proofs_are_domain_separated_and_bound_to_both_nonces():
    secret, other = b"s" * 32, b"t" * 32
    client_nonce, server_nonce = b"c" * 32, b"n" * 32
    server = protocol.server_proof(secret, client_nonce, server_nonce)
    client = protocol.client_proof(secret, server_nonce, client_nonce)
    assert len(server) == len(client) == protocol.PROOF_SIZE
    assert server != client  # a server's proof can never pass as a client's
    assert protocol.proof_matches(server, protocol.server_proof(secret, client_nonce,
                                                                server_nonce))
    assert not protocol.proof_matches(server, protocol.server_proof(other, client_nonce,
                                                                    server_nonce))
    assert client != protocol.client_proof(secret, server_nonce, b"d" * 32)
    assert protocol.new_nonce() != protocol.new_nonce()


def test_short_secrets_are_refused():
    with pytest.raises(DlfsError, match="at least 16"):
        protocol.check_secret(b"secret")
    assert protocol.check_secret(secrets.token_bytes(32))


@pytest.mark.parametrize(("limit", "offset", "length", "problem"), [
    (None, 0, 1, protocol.FAIL_UNKNOWN_CHUNK),
    (100, 0, 0, protocol.FAIL_BAD_LENGTH),
    (2 * protocol.MAX_READ, 0, protocol.MAX_READ + 1, protocol.FAIL_BAD_LENGTH),
    (100, 99, 2, protocol.FAIL_OUT_OF_RANGE),
    (100, 2**64 - 1, 1, protocol.FAIL_OUT_OF_RANGE),
    (100, 99, 1, None),
    (100, 0, 100, None),
    (protocol.MAX_READ, 0, protocol.MAX_READ, None),
])
def test_read_bounds(limit, offset, length, problem):
    assert protocol.read_bounds_problem(limit, offset, length) == problem


# -- fuzzing -----------------------------------------------------------------

def check_decoder_outcome(decoder: FrameDecoder, data: bytes) -> None:
    """The only acceptable outcomes: valid messages, or a ProtocolError."""
    try:
        messages = decoder.feed(data)
    except ProtocolError:
        return
    for msg in messages:
        assert protocol.validate(msg) is msg
        assert decode_all(protocol.encode(msg)) == [msg]


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000), st.integers(min_value=8, max_value=protocol.MAX_FRAME))
def test_fuzz_random_bytes(data, max_frame):
    check_decoder_outcome(FrameDecoder(max_frame), data)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats() | st.text(max_size=40) | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.sampled_from(["t", "id", "data"]), inner,
                      max_size=6),
    max_leaves=20,
)
field_values = (st.integers(min_value=-2, max_value=2**64 - 1) | st.binary(max_size=40)
                | st.sampled_from([b"x" * 16, b"x" * 32]) | st.text(max_size=10)
                | st.booleans() | st.none())
# Maps that look almost like real messages reach the field checks, not just the type check.
near_messages = st.builds(
    lambda kind, fields, extra: {"t": kind, **fields, **extra},
    st.sampled_from([*sorted(protocol.SCHEMAS), "nope"]),
    st.dictionaries(st.sampled_from(["v", "node", "nonce", "proof", "code", "msg", "id", "ds",
                                     "chunk", "off", "len", "data"]), field_values, max_size=6),
    st.dictionaries(st.sampled_from(["zz"]), field_values, max_size=1),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(msgpack_values | near_messages, min_size=1, max_size=4),
       st.integers(min_value=1, max_value=64))
def test_fuzz_valid_length_frames_of_random_msgpack(values, piece):
    stream = b"".join(frame(msgpack.packb(v, use_bin_type=True)) for v in values)
    whole = FrameDecoder()
    check_decoder_outcome(whole, stream)
    # Feeding in pieces gives the same messages (or fails too).
    pieces = FrameDecoder()
    try:
        expected = FrameDecoder().feed(stream)
    except ProtocolError:
        expected = None
    got: list = []
    try:
        for start in range(0, len(stream), piece):
            got += pieces.feed(stream[start:start + piece])
    except ProtocolError:
        got = None
    if expected is None:
        assert got is None
    else:
        assert got == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(0, protocol.MAX_REQUEST_ID), st.binary(max_size=70_000))
def test_data_frame_head_plus_payload_is_the_data_frame(request_id, payload):
    frame = protocol.data_frame_head(request_id, len(payload)) + payload
    assert protocol.FrameDecoder().feed(frame) == [protocol.data(request_id, payload)]


def test_data_frame_head_refuses_what_the_wire_cannot_carry():
    with pytest.raises(protocol.ProtocolError):
        protocol.data_frame_head(0, protocol.MAX_READ + 1)
    with pytest.raises(protocol.ProtocolError):
        protocol.data_frame_head(-1, 10)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, protocol.MAX_REQUEST_ID), st.binary(min_size=16, max_size=16),
       st.integers(0, protocol.MAX_UINT), st.integers(0, protocol.MAX_UINT),
       st.integers(0, protocol.MAX_UINT))
def test_read_frame_is_the_read_message(request_id, dataset_id, chunk, offset, length):
    """The client's packed READ decodes to exactly the message encode() would carry."""
    frame = protocol.read_frame(request_id, dataset_id, chunk, offset, length)
    expected = protocol.read(request_id, dataset_id, chunk, offset, length)
    assert protocol.FrameDecoder(protocol.MAX_CONTROL_FRAME).feed(frame) == [expected]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, protocol.MAX_REQUEST_ID), st.integers(0, protocol.MAX_UINT),
       st.integers(0, 10_000))
def test_a_read_frame_changed_anywhere_decodes_as_msgpack_says(request_id, offset, where):
    """The server's one-struct decoding of a READ takes only read_frame's exact layout:
    a frame with any byte of its layout changed decodes as the general way would, to
    another valid message or a ProtocolError, never to the READ it was."""
    body = bytearray(protocol.read_frame(request_id, DATASET, 1, offset, 4096)[4:])
    body[where % len(body)] ^= 0x01
    try:
        general = protocol.validate(msgpack.unpackb(bytes(body), raw=False))
    except Exception:
        general = None
    try:
        got = protocol.decode_body(bytes(body))
    except ProtocolError:
        got = None
    assert got == general


@settings(max_examples=300, deadline=None)
@given(st.integers(0, protocol.MAX_REQUEST_ID))
def test_a_data_head_packs_its_id_as_msgpack_does(request_id):
    head = protocol.data_frame_head(request_id, 10)
    assert msgpack.packb(request_id) in head
    assert protocol.FrameDecoder().feed(head + bytes(10)) == [protocol.data(request_id,
                                                                             bytes(10))]


@pytest.mark.parametrize("args", [
    (-1, DATASET, 0, 0, 0), (protocol.MAX_REQUEST_ID + 1, DATASET, 0, 0, 0),
    (0, DATASET[:15], 0, 0, 0), (0, DATASET + b"x", 0, 0, 0), (0, DATASET, -1, 0, 0),
    (0, DATASET, 0, protocol.MAX_UINT + 1, 0), (0, DATASET, 0, 0, -5)])
def test_read_frame_refuses_what_encode_refuses(args):
    with pytest.raises(protocol.ProtocolError):
        protocol.encode(protocol.read(*args))
    with pytest.raises(protocol.ProtocolError):
        protocol.read_frame(*args)


# -- versions and REPORT (version 2) ------------------------------------------------------
SECRET = b"s" * 32
BAD = protocol.BadRange(DATASET, 7, 4096, 1 << 20)


def shake_hands(client_version: int = protocol.PROTOCOL_VERSION,
                secret: bytes = SECRET) -> tuple[protocol.ClientHandshake,
                                                 protocol.ServerHandshake]:
    """A whole handshake between the two sans-I/O sides."""
    client = protocol.ClientHandshake(secret, "client", client_version)
    server = protocol.ServerHandshake(secret, "server")
    challenge = decode_all(protocol.encode(server.challenge_for(client.hello())))[0]
    client.finish(server.accept(client.auth_for(challenge)))
    return client, server


def test_a_version_2_server_speaks_to_version_1_and_2_clients_and_refuses_others():
    for version in (1, 2):
        client, server = shake_hands(version)
        assert server.version == version and client.reports == (version >= 2)
    for version in (0, protocol.PROTOCOL_VERSION + 1):
        server = protocol.ServerHandshake(SECRET, "server")
        with pytest.raises(protocol.HandshakeRefused) as refused:
            server.challenge_for(protocol.hello("c", NONCE, version))
        assert refused.value.reply["code"] == protocol.ERR_VERSION


def test_a_refused_version_is_told_apart_from_other_refusals():
    with pytest.raises(protocol.VersionRefused):
        protocol.expect(protocol.err(protocol.ERR_VERSION, "speaks 1"), protocol.CHALLENGE)
    with pytest.raises(protocol.HandshakeFailed) as failed:
        protocol.expect(protocol.err(protocol.ERR_AUTH, "no"), protocol.CHALLENGE)
    assert not isinstance(failed.value, protocol.VersionRefused)


def test_a_report_checks_out_once_on_its_own_connection_only():
    client, server = shake_hands()
    first, second = client.report(BAD), client.report(BAD)
    assert first["n"] == 1 and second["n"] == 2 and first["proof"] != second["proof"]
    assert server.check_report(decode_all(protocol.encode(first))[0]) == BAD
    with pytest.raises(ProtocolError, match="replayed"):
        server.check_report(first)
    assert server.check_report(second) == BAD
    _, other = shake_hands()  # same secret, other nonces: another connection's proof fails
    with pytest.raises(ProtocolError, match="wrong proof"):
        other.check_report(client.report(BAD))


@pytest.mark.parametrize("field, value", [("chunk", 8), ("off", 0), ("len", 1),
                                          ("ds", bytes(16))])
def test_a_report_whose_range_was_changed_fails_its_proof(field, value):
    client, server = shake_hands()
    msg = dict(client.report(BAD), **{field: value})
    with pytest.raises(ProtocolError, match="wrong proof"):
        server.check_report(msg)


def test_a_report_needs_version_2_and_the_secret():
    client, server = shake_hands(client_version=1)
    with pytest.raises(ProtocolError):
        client.report(BAD)
    forged = {"t": protocol.REPORT, "n": 1, "ds": DATASET, "chunk": 7, "off": 4096,
              "len": 1 << 20, "proof": bytes(32)}
    with pytest.raises(ProtocolError, match="version 1"):
        server.check_report(forged)
    outsider, _ = shake_hands(secret=b"o" * 32)
    _, server = shake_hands()
    with pytest.raises(ProtocolError, match="wrong proof"):
        server.check_report(outsider.report(BAD))

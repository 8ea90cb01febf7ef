"""The peer protocol of the chunk pool: frames and messages, without any I/O.

Daemons of one job serve byte ranges of the chunks they staged to each other
(docs/PROTOCOL.md). This module only turns bytes into checked messages and
back, so every rule about what a peer may send lives in one place that tests
can fuzz without sockets; dlfsd.pool.peer does the networking.

Everything that arrives is hostile until proven otherwise: a frame is a 4-byte
big-endian length plus a msgpack map, and the decoder refuses a length above
its limit before buffering the body, unpacks with tight msgpack limits, and
checks that the map is exactly one known message with correctly typed fields.
A request names (dataset uuid, chunk index, offset, length) and nothing else,
so no path from the network ever reaches a file system call.

Version 2 adds REPORT: a reader whose bytes from a peer failed their
checksum tells that peer which range, so it re-checks and re-stages its copy
at once. Each REPORT carries its own proof (HMAC over the connection's two
nonces, a per-connection sequence number and the range), so it cannot be
forged into, nor replayed on, any connection. A version 2 server still
serves version 1 clients; a version 2 client that a version 1 server refuses
connects again speaking version 1 (and reports nothing to it).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from dlfs.errors import DlfsError
from dlfs.store.format import MAX_EXTENT_SIZE

PROTOCOL_VERSION = 2  # what this daemon speaks, and offers first as a client
# The oldest version it still speaks: a server serves such clients, a client
# that a server of that version refuses falls back to it.
MIN_PROTOCOL_VERSION = 1
REPORT_VERSION = 2  # REPORT exists from this version on

# A reply carries at most one extent: a reader never needs more at once, and it
# bounds what a peer must buffer per request.
MAX_READ = MAX_EXTENT_SIZE
# Room for the map around the largest DATA payload.
FRAME_OVERHEAD = 4096
MAX_FRAME = MAX_READ + FRAME_OVERHEAD
# Every message except DATA fits here; a server accepts nothing larger, so an
# unauthenticated connection cannot make it buffer more than this.
MAX_CONTROL_FRAME = 4096

LENGTH_PREFIX = struct.Struct(">I")
NONCE_SIZE = 32
PROOF_SIZE = 32  # HMAC-SHA256
DATASET_ID_SIZE = 16
MIN_SECRET_SIZE = 16
MAX_NODE_NAME = 255  # bytes of UTF-8
MAX_CODE = 64
MAX_TEXT = 1024
MAX_REQUEST_ID = 2**32 - 1
MAX_UINT = 2**64 - 1

# Message types (the "t" field).
HELLO = "hello"
CHALLENGE = "challenge"
AUTH = "auth"
OK = "ok"
ERR = "err"
READ = "read"
DATA = "data"
MISS = "miss"
FAIL = "fail"
REPORT = "report"

# ERR codes: the connection is closed after an ERR.
ERR_VERSION = "version"
ERR_AUTH = "auth"
ERR_PROTOCOL = "protocol"

# FAIL codes: one request failed, the connection stays open.
FAIL_UNKNOWN_CHUNK = "unknown-chunk"  # dataset unknown here or chunk index out of range
FAIL_BAD_LENGTH = "bad-length"  # length 0 or above MAX_READ
FAIL_OUT_OF_RANGE = "out-of-range"  # offset + length beyond the chunk's data
FAIL_IO = "io-error"  # the peer could not read its own copy; try another source
# Not staged, and it will not be soon (over the owner's --cache-limit, or its cache disk
# cannot be written): read elsewhere, and do not wait for it (dlfsd.pool.replicate).
FAIL_NOT_STAGING = "not-staging"
BOUNDS_FAIL_CODES = frozenset({FAIL_UNKNOWN_CHUNK, FAIL_BAD_LENGTH, FAIL_OUT_OF_RANGE})

Message = dict[str, Any]


class ProtocolError(DlfsError):
    """The other side sent something this protocol version does not allow.

    The only sane reaction is to close the connection: after a malformed frame
    the byte stream can no longer be trusted to be in step.
    """


# -- field checks ------------------------------------------------------------

Check = Callable[[Any], bool]


def _uint(limit: int) -> Check:
    # type() rather than isinstance(): bool is an int subclass but never a valid field.
    return lambda v: type(v) is int and 0 <= v <= limit


def _bin(exact: int | None = None, limit: int = 0) -> Check:
    """Bytes: exactly `exact` of them, else at most `limit`."""

    def check(v: Any) -> bool:
        if not isinstance(v, (bytes, bytearray, memoryview)):
            return False
        size = v.nbytes if isinstance(v, memoryview) else len(v)
        return size == exact if exact is not None else size <= limit

    return check


def _text(limit: int) -> Check:
    return lambda v: type(v) is str and len(v.encode("utf-8", "surrogatepass")) <= limit


# The exact field set of every message. HELLO's shape is frozen across protocol
# versions so that a peer of another version gets an ERR_VERSION, not a
# protocol error.
SCHEMAS: dict[str, dict[str, Check]] = {
    HELLO: {"v": _uint(MAX_UINT), "node": _text(MAX_NODE_NAME), "nonce": _bin(NONCE_SIZE)},
    CHALLENGE: {"nonce": _bin(NONCE_SIZE), "proof": _bin(PROOF_SIZE)},
    AUTH: {"proof": _bin(PROOF_SIZE)},
    OK: {},
    ERR: {"code": _text(MAX_CODE), "msg": _text(MAX_TEXT)},
    # Lengths are checked against MAX_READ by the server (FAIL_BAD_LENGTH), not
    # here: a bad length is one refused request, not a broken connection.
    READ: {"id": _uint(MAX_REQUEST_ID), "ds": _bin(DATASET_ID_SIZE), "chunk": _uint(MAX_UINT),
           "off": _uint(MAX_UINT), "len": _uint(MAX_UINT)},
    DATA: {"id": _uint(MAX_REQUEST_ID), "data": _bin(limit=MAX_READ)},
    MISS: {"id": _uint(MAX_REQUEST_ID)},
    FAIL: {"id": _uint(MAX_REQUEST_ID), "code": _text(MAX_CODE)},
    # Version 2: bytes of this range failed their checksum at the client. No reply.
    REPORT: {"n": _uint(MAX_REQUEST_ID), "ds": _bin(DATASET_ID_SIZE), "chunk": _uint(MAX_UINT),
             "off": _uint(MAX_UINT), "len": _uint(MAX_UINT), "proof": _bin(PROOF_SIZE)},
}


def validate(msg: Any) -> Message:
    """Return `msg` if it is exactly one known, well-typed message; else raise ProtocolError."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a map, got {type(msg).__name__}")
    kind = msg.get("t")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {kind!r:.40}")
    if len(msg) != len(schema) + 1:
        extra = sorted(str(k) for k in msg.keys() - schema.keys() - {"t"})
        missing = sorted(schema.keys() - msg.keys())
        raise ProtocolError(f"{kind} message: missing fields {missing}, unexpected {extra}"[:200])
    for name, check in schema.items():
        if name not in msg:
            raise ProtocolError(f"{kind} message: missing field {name!r}")
        if not check(msg[name]):
            raise ProtocolError(f"{kind} message: field {name!r} has a bad type or size")
    return msg


# -- message constructors ---------------------------------------------------

def hello(node: str, nonce: bytes, version: int = PROTOCOL_VERSION) -> Message:
    return {"t": HELLO, "v": version, "node": node, "nonce": nonce}


def challenge(nonce: bytes, proof: bytes) -> Message:
    return {"t": CHALLENGE, "nonce": nonce, "proof": proof}


def auth(proof: bytes) -> Message:
    return {"t": AUTH, "proof": proof}


def ok() -> Message:
    return {"t": OK}


def err(code: str, text: str) -> Message:
    return {"t": ERR, "code": code, "msg": text[:MAX_TEXT]}


def read(request_id: int, dataset_id: bytes, chunk: int, offset: int, length: int) -> Message:
    return {"t": READ, "id": request_id, "ds": dataset_id, "chunk": chunk, "off": offset,
            "len": length}


def read_frame(request_id: int, dataset_id: bytes, chunk: int, offset: int,
               length: int) -> bytes:
    """The frame of read(...), made without building the map: the client's hot path.

    Why: encode(read(...)) builds a dict, validates it and packs it, ~3 us of a
    remote sample read on a slow core; this is one struct.pack. The integers are
    packed at fixed widths (uint32 for the id, uint64 for the rest) where msgpack
    would pick the smallest: any msgpack decoder reads both the same, so the
    frame decodes to exactly read(...) (tests/test_protocol.py checks it), and a
    value out of its field's range is refused here as encode() would.
    """
    if len(dataset_id) != DATASET_ID_SIZE:
        raise ProtocolError(f"read message: dataset id of {len(dataset_id)} bytes")
    try:
        return _READ_FRAME.pack(_READ_FRAME.size - LENGTH_PREFIX.size, _READ_HEAD, request_id,
                                _READ_DS, dataset_id, _READ_CHUNK, chunk, _READ_OFF, offset,
                                _READ_LEN, length)
    except struct.error:
        raise ProtocolError(f"read message: a field out of range (id {request_id}, chunk "
                            f"{chunk}, offset {offset}, length {length})") from None


def data(request_id: int, payload: bytes | bytearray | memoryview) -> Message:
    return {"t": DATA, "id": request_id, "data": payload}


def data_frame_head(request_id: int, length: int) -> bytes:
    """The bytes of a DATA frame that precede its payload.

    head + payload is one frame that decodes to data(request_id, payload), so a
    server can hand the payload to the kernel as it is (sendmsg) instead of
    copying it twice into a packed frame.
    """
    if not 0 <= request_id <= MAX_REQUEST_ID or not 0 <= length <= MAX_READ:
        raise ProtocolError(f"bad DATA frame: id {request_id}, {length} bytes")
    body_head = (_DATA_MAP_HEAD + _packed_uint(request_id) + _DATA_KEY
                 + b"\xc6" + length.to_bytes(4, "big"))  # bin 32 header
    return LENGTH_PREFIX.pack(len(body_head) + length) + body_head


def _packed_uint(n: int) -> bytes:
    """msgpack.packb(n) for 0 <= n < 2**32, without making a Packer per call (a DATA
    head is made for every READ on both sides): the smallest form, as msgpack's."""
    if n < 0x80:
        return _FIXINTS[n]
    if n < 0x100:
        return b"\xcc" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\xcd" + n.to_bytes(2, "big")
    return b"\xce" + n.to_bytes(4, "big")


_FIXINTS = [bytes([i]) for i in range(0x80)]

# read_frame's layout: map of 6, "t": "read", "id": uint32, "ds": bin8 of 16 bytes,
# "chunk", "off", "len": uint64 each; decode_body takes a body in exactly this layout
# (_READ_BODY: the frame less its prefix) by comparing its constant parts.
_READ_HEAD = b"\x86" + msgpack.packb("t") + msgpack.packb(READ) + msgpack.packb("id") + b"\xce"
_READ_DS = msgpack.packb("ds") + b"\xc4" + bytes([DATASET_ID_SIZE])
_READ_CHUNK = msgpack.packb("chunk") + b"\xcf"
_READ_OFF = msgpack.packb("off") + b"\xcf"
_READ_LEN = msgpack.packb("len") + b"\xcf"
_READ_FRAME = struct.Struct(
    f">I{len(_READ_HEAD)}sI{len(_READ_DS)}s{DATASET_ID_SIZE}s{len(_READ_CHUNK)}sQ"
    f"{len(_READ_OFF)}sQ{len(_READ_LEN)}sQ")
_READ_BODY = struct.Struct(">" + _READ_FRAME.format[2:])
_READ_CONSTANTS = (_READ_HEAD, _READ_DS, _READ_CHUNK, _READ_OFF, _READ_LEN)
_DATA_MAP_HEAD = b"\x83" + msgpack.packb("t") + msgpack.packb(DATA) + msgpack.packb("id")
_DATA_KEY = msgpack.packb("data")


def miss(request_id: int) -> Message:
    return {"t": MISS, "id": request_id}


def fail(request_id: int, code: str) -> Message:
    return {"t": FAIL, "id": request_id, "code": code}


@dataclass(frozen=True)
class BadRange:
    """A byte range of a chunk whose bytes failed their checksum (what a REPORT names)."""

    dataset_id: bytes
    chunk: int
    offset: int
    length: int


# -- authentication ----------------------------------------------------------
# Both sides prove they hold the job secret without sending it. Each proof
# covers both nonces, so it cannot be replayed on another connection, and the
# "server"/"client" prefixes keep one side's proof from being reflected back
# as the other's.

def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def check_secret(secret: bytes) -> bytes:
    """Refuse secrets short enough to guess offline from one captured handshake."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_SIZE:
        raise DlfsError(f"the peer secret must be at least {MIN_SECRET_SIZE} random bytes")
    return secret


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, b"server" + client_nonce + server_nonce, hashlib.sha256).digest()


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()


_REPORT_FIELDS = struct.Struct(">IQQQ")  # n, chunk, off, len: fixed width, unambiguous


def report_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes, n: int,
                 bad: BadRange) -> bytes:
    """The proof of REPORT number `n` on the connection whose handshake used these
    nonces: bound to the connection (the nonces), to its place on it (`n`, which only
    grows) and to the range, and prefixed so no handshake proof can pass for it."""
    fields = _REPORT_FIELDS.pack(n, bad.chunk, bad.offset, bad.length)
    return hmac.new(secret, b"report" + client_nonce + server_nonce + fields + bad.dataset_id,
                    hashlib.sha256).digest()


def proof_matches(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison, so timing does not leak how much of a proof was right."""
    return hmac.compare_digest(expected, got)


# -- the server side of the handshake ---------------------------------------

class HandshakeRefused(Exception):
    """The server ends the handshake: count it under `counter`, log `why`, send `reply`
    (an ERR, or None when the client already said why) and close. `cause`: the kind of
    failure, a fixed text under which failures are summed up in the log."""

    def __init__(self, counter: str, why: str, reply: Message | None,
                 cause: str = "") -> None:
        super().__init__(why)
        self.counter, self.why, self.reply = counter, why, reply
        self.cause = cause or why


class ServerHandshake:
    """The server's side of HELLO -> CHALLENGE -> AUTH -> OK, without I/O.

    The peer server (dlfsd.pool.peerserver) feeds it the client's two messages;
    the decisions, the proofs and the refusals live here, not in the loop.
    ClientHandshake is its twin.
    """

    def __init__(self, secret: bytes, node_name: str) -> None:
        self._secret = secret
        self.node_name = node_name
        self.client_node = "?"
        self.version = 0  # the client's, once its HELLO is accepted
        self._client_nonce = b""
        self._nonce = b""
        self._last_report = 0

    def challenge_for(self, hello_msg: Message) -> Message:
        """The CHALLENGE answering the client's HELLO."""
        if hello_msg["t"] != HELLO:
            raise ProtocolError(f"expected hello, got {hello_msg['t']}")
        self.client_node = hello_msg["node"]
        if not MIN_PROTOCOL_VERSION <= hello_msg["v"] <= PROTOCOL_VERSION:
            spoken = f"{MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
            raise HandshakeRefused(
                "protocol_errors",
                f"protocol version {hello_msg['v']}, this daemon speaks {spoken}",
                err(ERR_VERSION, f"node {self.node_name} speaks protocol versions "
                                 f"{spoken}, not {hello_msg['v']}"),
                "unsupported protocol version")
        self.version = hello_msg["v"]
        self._client_nonce, self._nonce = hello_msg["nonce"], new_nonce()
        return challenge(self._nonce, server_proof(self._secret, self._client_nonce,
                                                   self._nonce))

    def accept(self, answer: Message) -> Message:
        """OK once the client's AUTH proves the secret."""
        if answer["t"] == ERR:  # the client found our proof wrong
            raise HandshakeRefused(
                "auth_failures", f"rejected this server's proof ({answer['msg']}): the two "
                "daemons have different job secrets", None,
                "our proof rejected (different job secrets)")
        if answer["t"] != AUTH:
            raise ProtocolError(f"expected auth, got {answer['t']}")
        expected = client_proof(self._secret, self._nonce, self._client_nonce)
        if not proof_matches(expected, answer["proof"]):
            raise HandshakeRefused("auth_failures", "authentication failed (wrong job secret)",
                                   err(ERR_AUTH, "authentication failed"),
                                   "bad proof (wrong job secret)")
        return ok()

    def check_report(self, msg: Message) -> BadRange:
        """The range a REPORT names, once its proof and sequence number check out; a
        REPORT on a version 1 connection, replayed or with a wrong proof is a
        ProtocolError (the connection is closed: it cannot be trusted any more)."""
        if self.version < REPORT_VERSION:
            raise ProtocolError(f"report on a protocol version {self.version} connection")
        if msg["n"] <= self._last_report:
            raise ProtocolError(f"report number {msg['n']} after {self._last_report} "
                                "(replayed or out of order)")
        bad = BadRange(msg["ds"], msg["chunk"], msg["off"], msg["len"])
        expected = report_proof(self._secret, self._client_nonce, self._nonce, msg["n"], bad)
        if not proof_matches(expected, msg["proof"]):
            raise ProtocolError("report with a wrong proof")
        self._last_report = msg["n"]
        return bad


class HandshakeFailed(Exception):
    """The client gives up on a server: `reply` (an ERR, or None) is sent before closing.

    The text completes "peer ADDRESS ...", which each client prefixes.
    """

    def __init__(self, why: str, reply: Message | None = None) -> None:
        super().__init__(why)
        self.reply = reply


class VersionRefused(HandshakeFailed):
    """The server does not speak the version the HELLO offered (ERR `version`)."""


class ClientHandshake:
    """The client's side of HELLO -> CHALLENGE -> AUTH -> OK, without I/O.

    The trio client (dlfsd.pool.peer) and the workers' blocking client
    (dlfsd.pool.peersync) send what it returns and feed it what they receive;
    the proofs and what counts as a refusal live here once.
    """

    def __init__(self, secret: bytes, node_name: str,
                 version: int = PROTOCOL_VERSION) -> None:
        self._secret = secret
        self.node_name = node_name
        self.version = version
        self._nonce = b""
        self._server_nonce = b""
        self._reports = 0

    def hello(self) -> Message:
        """The HELLO that opens the handshake."""
        self._nonce = new_nonce()
        return hello(self.node_name, self._nonce, self.version)

    def auth_for(self, challenge_msg: Message | None) -> Message:
        """The AUTH answering the server's CHALLENGE, once its proof checks out."""
        msg = expect(challenge_msg, CHALLENGE)
        expected = server_proof(self._secret, self._nonce, msg["nonce"])
        if not proof_matches(expected, msg["proof"]):
            raise HandshakeFailed("failed authentication (different job secret)",
                                  err(ERR_AUTH, "server proof does not match"))
        self._server_nonce = msg["nonce"]
        return auth(client_proof(self._secret, msg["nonce"], self._nonce))

    def finish(self, answer: Message | None) -> None:
        """Check the server's OK: the connection is ready for requests."""
        expect(answer, OK)

    @property
    def reports(self) -> bool:
        """Whether this connection may carry REPORTs (the server speaks version 2)."""
        return self.version >= REPORT_VERSION and bool(self._server_nonce)

    def report(self, bad: BadRange) -> Message:
        """The next REPORT on this connection (after finish; only if `reports`)."""
        if not self.reports:
            raise ProtocolError(f"no report on a protocol version {self.version} connection")
        self._reports += 1
        return {"t": REPORT, "n": self._reports, "ds": bad.dataset_id, "chunk": bad.chunk,
                "off": bad.offset, "len": bad.length,
                "proof": report_proof(self._secret, self._nonce, self._server_nonce,
                                      self._reports, bad)}


def expect(msg: Message | None, kind: str) -> Message:
    """`msg` if it is a `kind` message; a refusal (ERR) or an end of stream (None) raise
    HandshakeFailed, any other message ProtocolError."""
    if msg is None:
        raise HandshakeFailed("closed the connection during the handshake")
    if msg["t"] == ERR:
        refused = VersionRefused if msg["code"] == ERR_VERSION else HandshakeFailed
        raise refused(f"refused the connection: {msg['code']}: {msg['msg']}")
    if msg["t"] != kind:
        raise ProtocolError(f"expected {kind}, got {msg['t']}")
    return msg


# -- request bounds ------------------------------------------------------------

def read_bounds_problem(chunk_length: int | None, offset: int, length: int) -> str | None:
    """The FAIL code for a READ of `length` bytes at `offset` of a chunk, or None if valid.

    `chunk_length` is the chunk's data length, None when the dataset is unknown
    here or the chunk index is out of range.
    """
    if chunk_length is None:
        return FAIL_UNKNOWN_CHUNK
    if not 1 <= length <= MAX_READ:
        return FAIL_BAD_LENGTH
    if offset + length > chunk_length:
        return FAIL_OUT_OF_RANGE
    return None


# -- frames ------------------------------------------------------------------

def encode(msg: Message) -> bytes:
    """One frame (length prefix + msgpack map) holding `msg`, after checking it."""
    body = msgpack.packb(validate(msg), use_bin_type=True)
    return LENGTH_PREFIX.pack(len(body)) + body


def decode_body(body: bytes | bytearray | memoryview) -> Message:
    """Unpack and validate one frame body; raise ProtocolError on anything else.

    A READ laid out as read_frame makes it (what this client sends) is unpacked with
    one struct call: its fields are well typed by their layout, so the message is
    the one the general way would return. Any other body goes the general way."""
    if len(body) == _READ_BODY.size:
        fields = _READ_BODY.unpack(body)
        if fields[::2] == _READ_CONSTANTS:
            return {"t": READ, "id": fields[1], "ds": fields[3], "chunk": fields[5],
                    "off": fields[7], "len": fields[9]}
    try:
        msg = msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True,
            max_bin_len=MAX_READ, max_str_len=MAX_TEXT, max_array_len=16, max_map_len=8,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ProtocolError(f"frame body is not valid msgpack ({type(error).__name__})") from None
    return validate(msg)


class FrameDecoder:
    """Incremental decoder: feed received bytes, get the complete messages so far.

    Sans-I/O so it can be fuzzed directly. A length prefix above `max_frame`
    is refused as soon as its 4 bytes arrive, before any of the body is
    buffered. After a ProtocolError the decoder stays broken: the stream is no
    longer in step and must be closed.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held (nonzero at EOF means a truncated frame)."""
        return len(self._buffer)

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[Message]:
        if self._error is not None:
            raise self._error
        self._buffer += chunk
        messages = []
        try:
            while (msg := self._next_message()) is not None:
                messages.append(msg)
        except ProtocolError as error:
            self._error = error
            self._buffer = bytearray()
            raise
        return messages

    def _next_message(self) -> Message | None:
        if len(self._buffer) < LENGTH_PREFIX.size:
            return None
        (size,) = LENGTH_PREFIX.unpack_from(self._buffer)
        if size > self.max_frame:
            raise ProtocolError(f"frame of {size} bytes exceeds the limit of {self.max_frame}")
        end = LENGTH_PREFIX.size + size
        if len(self._buffer) < end:
            return None
        # Unpack straight from the buffer (no copy of a 4 MiB body); the view
        # must be released before the buffer is resized.
        with memoryview(self._buffer)[LENGTH_PREFIX.size:end] as body:
            msg = decode_body(body)
        del self._buffer[:end]
        return msg

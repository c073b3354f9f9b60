"""The chunk record: a fixed header (layout, shape, dtype, layer, prefix digest, checksum), the
payload, and for KV payloads a table of per-row checksums. Pure Python: the store server handles
records as bytes and needs no torch.

A KV payload is keys then values, each ``[heads, tokens, head_dim]``; a *row* is one token of one
head of K or V. The per-row checksum table lets a reader fetch only some rows (the tokens the
accelerator does not already hold exactly) and still check every byte it uses. Every field is
checked on decode; a record that fails any check raises ``ChunkError`` and is never used.

    record = header | payload | row_sums (uint64 per row, KV kind only)

A row's sum is ``sum_i w_i * P_i mod 2**64`` over its 32-bit words ``w_i`` with fixed odd 64-bit
multipliers ``P_i``: any change to one word changes it, and it is computed for all rows at once
(vectorised), which per-row CRCs in Python could not be at the rate records are written.

The header's checksum covers the payload and the table, so a whole-record read checks every byte.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"VCKV"
VERSION = 2
# kind: what the payload holds
KIND_KV = 0  # keys then values, each [heads, tokens, head_dim] in ``dtype``, then the row-CRC table
KIND_PACKED = 1  # opaque packed bytes (quantized KV); shape fields describe the logical KV
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float64": 4, "uint8": 5}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1}

# magic, version, kind, dtype, layer, heads, tokens, head_dim, start, layout digest (8 bytes
# from hex), prefix digest, crc32 of payload and row table, payload length
_HEADER = struct.Struct("<4sBBBxIIIIQ8s16sIQ")
HEADER_SIZE = _HEADER.size
ROW_SUM_BYTES = 8
_MULTIPLIERS: dict[int, object] = {}


class ChunkError(ValueError):
    """A stored chunk that is malformed, corrupt, or not the chunk that was asked for."""


@dataclass(frozen=True)
class ChunkHeader:
    kind: int
    dtype: str
    layer: int
    heads: int
    tokens: int
    head_dim: int
    start: int
    layout_digest: str  # 16 hex chars
    prefix_digest: bytes  # 16 bytes
    crc32: int
    payload_len: int

    @property
    def row_bytes(self) -> int:
        return self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def num_rows(self) -> int:
        return 2 * self.heads * self.tokens if self.kind == KIND_KV else 0

    def expected_payload_len(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def record_len(self) -> int:
        return HEADER_SIZE + self.payload_len + ROW_SUM_BYTES * self.num_rows

    def row_index(self, kv: int, head: int, token: int) -> int:
        """Row of token ``token`` (within the chunk) of head ``head`` of K (``kv=0``) or V (1)."""
        return (kv * self.heads + head) * self.tokens + token

    def rows_range(self, first_row: int, count: int) -> tuple[int, int]:
        """Byte (offset, length) of ``count`` consecutive rows in the record."""
        return HEADER_SIZE + first_row * self.row_bytes, count * self.row_bytes

    def sums_range(self, first_row: int, count: int) -> tuple[int, int]:
        """Byte (offset, length) of those rows' checksums in the record."""
        return HEADER_SIZE + self.payload_len + ROW_SUM_BYTES * first_row, ROW_SUM_BYTES * count


def row_sums(rows: bytes | memoryview, row_bytes: int):
    """The checksum (uint64 numpy array) of each ``row_bytes``-long row of ``rows``."""
    import numpy as np

    if row_bytes % 4:
        raise ChunkError(f"rows of {row_bytes} bytes are not whole 32-bit words")
    words = row_bytes // 4
    mult = _MULTIPLIERS.get(words)
    if mult is None:  # fixed odd multipliers from a fixed-seed generator: the same in every process
        mult = np.random.default_rng(0x5EED).integers(0, 2**63, size=words, dtype=np.uint64) * 2 + 1
        _MULTIPLIERS[words] = mult
    w = np.frombuffer(rows, dtype="<u4").astype(np.uint64).reshape(-1, words)
    with np.errstate(over="ignore"):
        return (w * mult).sum(axis=1, dtype=np.uint64)


def encode(header: ChunkHeader, payload: bytes | memoryview) -> bytes:
    view = memoryview(payload).cast("B")
    if header.kind == KIND_KV and len(view) != header.expected_payload_len():
        raise ChunkError(f"payload of {len(view)} bytes, header implies {header.expected_payload_len()}")
    table = row_sums(view, header.row_bytes).astype("<u8").tobytes() if header.kind == KIND_KV else b""
    raw = _HEADER.pack(
        MAGIC,
        VERSION,
        header.kind,
        DTYPE_CODES[header.dtype],
        header.layer,
        header.heads,
        header.tokens,
        header.head_dim,
        header.start,
        bytes.fromhex(header.layout_digest),
        header.prefix_digest,
        zlib.crc32(table, zlib.crc32(view)),
        len(view),
    )
    return b"".join((raw, view, table))


def decode_header(head: bytes | memoryview) -> ChunkHeader:
    """Parse and check the fixed header (the first ``HEADER_SIZE`` bytes of a record)."""
    view = memoryview(head)
    if len(view) < HEADER_SIZE:
        raise ChunkError(f"record of {len(view)} bytes is shorter than the {HEADER_SIZE}-byte header")
    (magic, version, kind, dtype_code, layer, heads, tokens, head_dim, start, layout, prefix, crc, length) = (
        _HEADER.unpack_from(view)
    )
    if magic != MAGIC:
        raise ChunkError(f"bad magic {magic!r}: not a VeriCache chunk")
    if version != VERSION:
        raise ChunkError(f"chunk format version {version}, this reader knows {VERSION}")
    if dtype_code not in DTYPE_NAMES or kind not in (KIND_KV, KIND_PACKED):
        raise ChunkError(f"unknown dtype code {dtype_code} or kind {kind}")
    header = ChunkHeader(
        kind, DTYPE_NAMES[dtype_code], layer, heads, tokens, head_dim, start, layout.hex(), prefix, crc, length
    )
    if kind == KIND_KV and length != header.expected_payload_len():
        raise ChunkError(f"payload of {length} bytes does not fit shape {heads}x{tokens}x{head_dim}")
    return header


def decode(record: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Parse and check a whole record's framing and payload checksum; return header and payload."""
    view = memoryview(record)
    header = decode_header(view)
    if len(view) != header.record_len:
        raise ChunkError(f"record of {len(view)} bytes, its header implies {header.record_len}")
    if zlib.crc32(view[HEADER_SIZE:]) != header.crc32:
        raise ChunkError("checksum mismatch: the chunk is corrupt")
    return header, view[HEADER_SIZE : HEADER_SIZE + header.payload_len]


def check_rows(header: ChunkHeader, first_row: int, rows: bytes | memoryview, sums: bytes | memoryview) -> None:
    """Check rows read on their own against their entries of the row-checksum table."""
    import numpy as np

    rb = header.row_bytes
    count = len(rows) // rb
    if len(rows) != count * rb or len(sums) != ROW_SUM_BYTES * count:
        raise ChunkError(f"partial read of {len(rows)} row bytes and {len(sums)} checksum bytes is malformed")
    bad = np.nonzero(row_sums(rows, rb) != np.frombuffer(sums, dtype="<u8"))[0]
    if bad.size:
        raise ChunkError(f"checksum mismatch in row {first_row + int(bad[0])}: the chunk is corrupt")


def check(
    header: ChunkHeader, *, layout_digest: str, prefix_digest: bytes, layer: int, tokens: int, start: int
) -> None:
    """Check that a decoded chunk is the one asked for."""
    if header.layout_digest != layout_digest:
        raise ChunkError(f"chunk of layout {header.layout_digest}, expected {layout_digest} (another model?)")
    if header.prefix_digest != prefix_digest:
        raise ChunkError("chunk's token-prefix digest does not match the request's tokens")
    if (header.layer, header.tokens, header.start) != (layer, tokens, start):
        raise ChunkError(
            f"chunk holds layer {header.layer}, tokens [{header.start}, {header.start + header.tokens}); "
            f"expected layer {layer}, tokens [{start}, {start + tokens})"
        )

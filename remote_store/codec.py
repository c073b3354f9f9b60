"""The chunk record: a fixed header (layout, shape, dtype, layer, prefix digest, checksum) then the
payload bytes. Pure Python: the store server handles records as bytes and needs no torch.

Every field is checked on decode; a record that fails any check raises ``ChunkError`` and is
never used.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"VCKV"
VERSION = 1
# kind: what the payload holds
KIND_KV = 0  # keys then values, each [heads, tokens, head_dim] in ``dtype``
KIND_PACKED = 1  # opaque packed bytes (quantized KV); shape fields describe the logical KV
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float64": 4, "uint8": 5}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1}

# magic, version, kind, dtype, layer, heads, tokens, head_dim, start, layout digest (8 bytes
# from hex), prefix digest, crc32, payload length
_HEADER = struct.Struct("<4sBBBxIIIIQ8s16sIQ")
HEADER_SIZE = _HEADER.size


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

    def expected_payload_len(self) -> int:
        return 2 * self.heads * self.tokens * self.head_dim * DTYPE_SIZES[self.dtype]


def encode(header: ChunkHeader, payload: bytes | memoryview) -> bytes:
    if header.kind == KIND_KV and len(payload) != header.expected_payload_len():
        raise ChunkError(f"payload of {len(payload)} bytes, header implies {header.expected_payload_len()}")
    raw = _HEADER.pack(
        MAGIC, VERSION, header.kind, DTYPE_CODES[header.dtype], header.layer, header.heads, header.tokens,
        header.head_dim, header.start, bytes.fromhex(header.layout_digest), header.prefix_digest,
        zlib.crc32(payload), len(payload),
    )
    return raw + bytes(payload)


def decode(record: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Parse and check a record's framing and checksum; return its header and payload."""
    view = memoryview(record)
    if len(view) < HEADER_SIZE:
        raise ChunkError(f"record of {len(view)} bytes is shorter than the {HEADER_SIZE}-byte header")
    (magic, version, kind, dtype_code, layer, heads, tokens, head_dim, start, layout, prefix, crc,
     length) = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise ChunkError(f"bad magic {magic!r}: not a VeriCache chunk")
    if version != VERSION:
        raise ChunkError(f"chunk format version {version}, this reader knows {VERSION}")
    if dtype_code not in DTYPE_NAMES or kind not in (KIND_KV, KIND_PACKED):
        raise ChunkError(f"unknown dtype code {dtype_code} or kind {kind}")
    payload = view[HEADER_SIZE:]
    if len(payload) != length:
        raise ChunkError(f"payload of {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise ChunkError("checksum mismatch: the chunk is corrupt")
    header = ChunkHeader(kind, DTYPE_NAMES[dtype_code], layer, heads, tokens, head_dim, start,
                         layout.hex(), prefix, crc, length)
    if kind == KIND_KV and length != header.expected_payload_len():
        raise ChunkError(f"payload of {length} bytes does not fit shape {heads}x{tokens}x{head_dim}")
    return header, payload


def check(header: ChunkHeader, *, layout_digest: str, prefix_digest: bytes, layer: int, tokens: int,
          start: int) -> None:
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

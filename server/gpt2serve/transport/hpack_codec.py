"""HPACK (RFC 7541) for the built-in gRPC server: a decoder for requests, plain literals for answers.

The decoder keeps the peer's dynamic table; gRPC clients index the headers they repeat, so after
a connection's first call a request's headers are one byte each, decoded here by a table lookup.
The static table and Huffman code are the `hpack` package's (the RFC's own data); `hpack`'s own
Decoder costs about 19 µs for a gRPC request's eight indexed fields, this one a few.

Answers are encoded as literals that are never indexed, so the peer's table of ours stays empty:
the first header block of a connection sets it to size 0, and no later SETTINGS needs an update.
"""

from __future__ import annotations

from collections import deque

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

STATIC = HeaderTable.STATIC_TABLE  # 61 (name, value) pairs, index 1 first
ENTRY_OVERHEAD = 32  # RFC 7541 4.1: an entry's size is its name and value plus 32
TABLE_SIZE_ZERO = b"\x20"  # a dynamic table size update to 0
Header = tuple[bytes, bytes]


class HpackError(ValueError):
    """A header block that cannot be decoded: the connection ends with COMPRESSION_ERROR."""


def encode_integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(name: bytes, value: bytes) -> bytes:
    """A literal field without indexing and with a literal name (RFC 7541 6.2.2), no Huffman."""
    return b"\x00" + encode_integer(len(name), 7) + name + encode_integer(len(value), 7) + value


class HeaderDecoder:
    """One connection's request headers. `max_table_size` is what our SETTINGS allowed."""

    def __init__(self, max_table_size: int = 4096, max_list_size: int = 65536):
        self.max_table_size = self.table_limit = max_table_size
        self.max_list_size = max_list_size
        self.table: deque[Header] = deque()  # newest first: dynamic index 62 is table[0]
        self.table_size = 0
        self.huffman_seen: dict[bytes, bytes] = {}  # repeated Huffman strings (a path, a timeout)

    def decode(self, block: bytes) -> list[Header]:
        headers: list[Header] = []
        size, pos, end = 0, 0, len(block)
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = self._integer(block, pos, 7)
                header = self._entry(index)
            elif byte & 0x40:  # literal, added to the table
                header, pos = self._literal(block, pos, 6)
                self._add(header)
            elif byte & 0x20:  # table size update
                new_size, pos = self._integer(block, pos, 5)
                if new_size > self.max_table_size:
                    raise HpackError(f"table size {new_size} above the {self.max_table_size} allowed")
                self.table_limit = new_size
                self._evict()
                continue
            else:  # literal, not indexed (0000) or never indexed (0001)
                header, pos = self._literal(block, pos, 4)
            size += len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
            if size > self.max_list_size:
                raise HpackError(f"header list larger than {self.max_list_size} bytes")
            headers.append(header)
        return headers

    def _integer(self, block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
        limit = (1 << prefix_bits) - 1
        value = block[pos] & limit
        pos += 1
        if value < limit:
            return value, pos
        shift = 0
        while True:
            if pos >= len(block) or shift > 28:
                raise HpackError("integer cut short or too large")
            byte = block[pos]
            pos += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value, pos

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        huffman = block[pos] & 0x80
        length, pos = self._integer(block, pos, 7)
        raw = block[pos:pos + length]
        if len(raw) != length:
            raise HpackError("string cut short")
        if not huffman:
            return raw, pos + length
        text = self.huffman_seen.get(raw)
        if text is None:
            try:
                text = decode_huffman(raw)
            except Exception as exc:
                raise HpackError(f"bad Huffman string: {exc}") from None
            if len(self.huffman_seen) < 256 and length <= 128:  # short ones only: a peer's large strings are not kept
                self.huffman_seen[raw] = text
        return text, pos + length

    def _literal(self, block: bytes, pos: int, prefix_bits: int) -> tuple[Header, int]:
        index, pos = self._integer(block, pos, prefix_bits)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = self._string(block, pos)
        value, pos = self._string(block, pos)
        return (name, value), pos

    def _entry(self, index: int) -> Header:
        if 0 < index <= len(STATIC):
            return STATIC[index - 1]
        dynamic = index - len(STATIC) - 1
        if 0 <= dynamic < len(self.table):
            return self.table[dynamic]
        raise HpackError(f"no header at index {index}")

    def _add(self, header: Header) -> None:
        self.table.appendleft(header)
        self.table_size += len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
        self._evict()

    def _evict(self) -> None:
        while self.table_size > self.table_limit:
            name, value = self.table.pop()
            self.table_size -= len(name) + len(value) + ENTRY_OVERHEAD

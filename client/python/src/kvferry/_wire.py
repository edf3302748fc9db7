"""Protobuf wire encoding for the bulk messages, so rows and page bytes are copied once.

The generated classes would copy every row buffer three times (into bytes, into the
message, into the serialized string) and build one Python object per token location
(about 4 us each). Here the locations are encoded with numpy in one pass and the bulk
field is appended to the serialized header, which is valid protobuf: a message is the
concatenation of its fields, in any order. Field numbers come from the generated
descriptors, never from literals; tests parse every encoding back with the generated
classes.
"""

from __future__ import annotations

import numpy as np

_LEN = 2  # wire type of length-delimited fields
_VARINT = 0


def varint(value: int) -> bytes:
    """The base-128 varint encoding of a non-negative int below 2**64."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def varint_field(number: int, value: int) -> bytes:
    """A varint field, written even when zero (so proto3 `optional` fields are present)."""
    return tag(number, _VARINT) + varint(value)


def bytes_header(number: int, length: int) -> bytes:
    """Tag and length of a length-delimited field; its `length` bytes follow."""
    return tag(number, _LEN) + varint(length)


def bytes_field(number: int, data: bytes) -> bytes:
    return bytes_header(number, len(data)) + data


def _varints(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Varints of uint64 `values` [n]: bytes [n, w] (left-aligned; w is the longest
    encoding, so typically 1-3 columns) and lengths [n]."""
    values = values.astype(np.uint64, copy=False)
    top = int(values.max()) if values.size else 0
    width = max(1, (top.bit_length() + 6) // 7)
    lengths = np.ones(values.shape, dtype=np.int64)
    for k in range(1, width):
        lengths += values >= np.uint64(1 << (7 * k))
    shifts = np.arange(0, 7 * width, 7, dtype=np.uint64)
    groups = ((values[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    groups[np.arange(width)[None, :] < (lengths[:, None] - 1)] |= 0x80
    return groups, lengths


def token_locations(number: int, page_ids: np.ndarray, generations: np.ndarray,
                    slots: np.ndarray) -> bytes:
    """Repeated TokenLocation field `number`: one entry per (page_id, generation, slot).

    Encodes TokenLocation{page: PageHandle{page_id: 1, generation: 2}, slot: 2} with every
    field present; the inner lengths stay below 128, so each is one byte.
    """
    n = len(page_ids)
    if n == 0:
        return b""
    pid, pid_len = _varints(page_ids)
    gen, gen_len = _varints(generations)
    slot, slot_len = _varints(slots)
    handle_len = 2 + pid_len + gen_len        # 0x08 pid 0x10 gen
    location_len = 2 + handle_len + 1 + slot_len  # 0x0a len handle 0x10 slot

    def const(value: int) -> np.ndarray:
        return np.full((n, 1), value, dtype=np.uint8)

    def column(values: np.ndarray) -> np.ndarray:
        return values.astype(np.uint8).reshape(n, 1)

    def used(lengths: np.ndarray, columns: np.ndarray) -> np.ndarray:
        return np.arange(columns.shape[1])[None, :] < lengths[:, None]

    ones = np.ones((n, 1), dtype=bool)
    parts = [const(number << 3 | _LEN), column(location_len), const(1 << 3 | _LEN),
             column(handle_len), const(1 << 3 | _VARINT), pid, const(2 << 3 | _VARINT), gen,
             const(2 << 3 | _VARINT), slot]
    keep = [ones, ones, ones, ones, ones, used(pid_len, pid), ones, used(gen_len, gen), ones,
            used(slot_len, slot)]
    # Row-major boolean selection keeps each location's bytes together and in order.
    return np.concatenate(parts, axis=1)[np.concatenate(keep, axis=1)].tobytes()


def fields(message: memoryview):
    """Yields (number, value) for each field of a serialized message: an int for varints,
    a memoryview into `message` for length-delimited fields. Fixed-width fields are
    skipped (the chunk messages have none). Raises ValueError on malformed input."""
    pos, end = 0, len(message)

    def read_varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            if pos >= end or shift > 63:
                raise ValueError("truncated or overlong varint")
            byte = message[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7

    while pos < end:
        key = read_varint()
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            yield number, read_varint()
        elif wire_type == _LEN:
            length = read_varint()
            if pos + length > end:
                raise ValueError("length-delimited field runs past the message")
            yield number, message[pos:pos + length]
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
    if pos != end:
        raise ValueError("truncated fixed-width field")

"""Confluent's wire format header, read in one place for every registry-backed format (Avro,
Protobuf, JSON Schema): magic byte 0, then the writer's schema ID as 4 bytes big-endian, then the
serialized value (for Protobuf, message indexes come first; protobuf/decoder.py reads those).

Invariant: every non-null input is either split into (schema ID, payload) or named in ``errors``
with the reason its framing is wrong; a null input stays null and is no error. Headers are read
for a whole batch at once from the Arrow buffers, never record by record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

MAGIC_BYTE = 0
HEADER_SIZE = 5  # magic byte + 4-byte schema ID
NO_SCHEMA = -1  # the schema ID of a null input or of one with wrong framing


@dataclass(frozen=True)
class Frames:
    """``schema_ids[i]`` is input i's writer schema ID (NO_SCHEMA where it has none) and
    ``payloads[i]`` its bytes after the header (null where the input is null or in ``errors``)."""

    schema_ids: np.ndarray
    payloads: pa.Array
    errors: dict[int, str] = field(default_factory=dict)


def split_frames(values: pa.Array) -> Frames:
    """Reads the header of every value (binary or large_binary, nulls allowed)."""
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if not (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
        raise TypeError(f"Confluent-framed values must be binary, not {values.type}")
    count = len(values)
    offsets_type = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    buffers = values.buffers()
    offsets = np.frombuffer(buffers[1], dtype=offsets_type)[values.offset: values.offset + count + 1].astype(np.int64)
    data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    valid = values.is_valid().to_numpy(zero_copy_only=False)

    whole_header = valid & (lengths >= HEADER_SIZE)
    # Header bytes are read only where a whole header exists; elsewhere position 0 of a padded copy.
    starts = np.where(whole_header, offsets[:-1], 0)
    padded = np.concatenate([data, np.zeros(HEADER_SIZE, np.uint8)])
    magic = padded[starts]
    framed = whole_header & (magic == MAGIC_BYTE)
    ids = np.zeros(count, np.int64)
    for position in range(1, HEADER_SIZE):
        ids = (ids << 8) | padded[starts + position]
    schema_ids = np.where(framed, ids, NO_SCHEMA)

    errors: dict[int, str] = {}
    for i in np.flatnonzero(valid & ~whole_header).tolist():
        errors[i] = (f"value is {int(lengths[i])} bytes, too short for Confluent framing "
                     "(magic byte 0 and a 4-byte schema ID)")
    for i in np.flatnonzero(whole_header & ~framed).tolist():
        errors[i] = _wrong_magic(int(magic[i]))

    return Frames(schema_ids, _payloads(values.type, offsets, data, lengths, framed), dict(sorted(errors.items())))


def strip_confluent_framing(values: pa.Array) -> tuple[pa.Array, dict[int, str]]:
    """The values after their 5-byte header (e.g. JSON written by Confluent's JSON Schema
    serializer) and, by index, the reason a value's framing is wrong (its payload is null)."""
    frames = split_frames(values)
    return frames.payloads, frames.errors


def _payloads(kind: pa.DataType, offsets: np.ndarray, data: np.ndarray, lengths: np.ndarray,
              framed: np.ndarray) -> pa.Array:
    """The framed values without their headers, null elsewhere: the data buffer with each header
    (and every other value's bytes) left out. (pyarrow 26's binary_slice fails on values shorter
    than the slice start, so it cannot do this.)"""
    first, starts = offsets[0], offsets[:-1] - offsets[0]
    keep = np.ones(int(offsets[-1] - first), dtype=bool)
    keep[(starts[framed, None] + np.arange(HEADER_SIZE)).ravel()] = False
    for i in np.flatnonzero(~framed & (lengths > 0)).tolist():
        keep[starts[i]: starts[i] + lengths[i]] = False
    payload_lengths = np.where(framed, lengths - HEADER_SIZE, 0)
    payload_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(payload_lengths, out=payload_offsets[1:])
    offset_type = np.int64 if pa.types.is_large_binary(kind) else np.int32
    validity = None if framed.all() else pa.array(framed).buffers()[1]
    return pa.Array.from_buffers(kind, len(lengths), [
        validity, pa.py_buffer(payload_offsets.astype(offset_type)), pa.py_buffer(data[first: offsets[-1]][keep])],
        null_count=int(len(lengths) - framed.sum()))


def _wrong_magic(first_byte: int) -> str:
    if first_byte == 1:
        return ("value starts with magic byte 1 (schema GUID framing), which oncemore does not read: "
                "configure the serializer to write schema IDs (magic byte 0)")
    shown = repr(chr(first_byte)) if 32 <= first_byte < 127 else f"byte 0x{first_byte:02x}"
    return f"value starts with {shown}, not Confluent's magic byte 0: not written by a schema registry serializer"

"""A byte range of each value of a binary array, cut for the whole batch at once: the payload after
a wire header (framing.py), the payload inside Kafka Connect's JSON wrapper (json/connect.py).

Invariant: value i of the result is exactly bytes [starts[i], stops[i]) of input value i, or null
where ``valid`` is false; no byte of another value is ever in it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def byte_ranges(values: pa.Array, starts: np.ndarray, stops: np.ndarray, valid: np.ndarray) -> pa.Array:
    """``values`` (binary or large_binary) cut to [starts[i], stops[i]) each (offsets within the
    value), null where ``valid`` is false; the result has the input's type."""
    count = len(values)
    offset_type = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    buffers = values.buffers()
    offsets = np.frombuffer(buffers[1], dtype=offset_type)[values.offset: values.offset + count + 1].astype(np.int64)
    data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    first = offsets[0]
    lengths = np.where(valid, stops - starts, 0)
    # Each kept range marked +1 at its start and -1 at its end: their running sum is 1 inside a range.
    # (Starts are distinct, each inside its own value, and so are ends.)
    marks = np.zeros(int(offsets[-1] - first) + 1, dtype=np.int8)
    begins = (offsets[:-1] - first + starts)[lengths > 0]
    marks[begins] += 1
    marks[begins + lengths[lengths > 0]] -= 1
    keep = np.cumsum(marks[:-1], dtype=np.int8).astype(bool)
    new_offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    validity = None if valid.all() else pa.array(valid).buffers()[1]
    return pa.Array.from_buffers(values.type, count, [
        validity, pa.py_buffer(new_offsets.astype(offset_type)), pa.py_buffer(data[first: offsets[-1]][keep])],
        null_count=int(count - valid.sum()))

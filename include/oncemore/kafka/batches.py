"""One task's Kafka records as Arrow batches, bounded in rows and bytes, stopping at a byte budget.

Batches carry the Spark Kafka source's columns (key, value, topic, partition, offset, timestamp,
timestampType, headers: read only when asked for, else null) plus ``timestamp_ms``, Kafka's raw
value: where it cannot be held as a microsecond timestamp (a producer stamping nanoseconds),
``timestamp`` is null and the decoder quarantines the record. A batch holds at most BATCH_ROWS
rows or about BATCH_BYTES of keys and values (and always at least one record), and what the
client hands over is copied one ``consume()`` list at a time (at most 10,000 messages, within
its bounded prefetch queue), so a task's memory follows these bounds, not its range or the
values' size. With a byte budget the read stops after the record that reaches it; ``reached``
then says where the next read must begin (the range end when the whole range was read).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Consumer, Message

from oncemore.core.columns import HEADERS_TYPE, TIMESTAMP
from oncemore.kafka.clients import read_messages

# The Spark Kafka source's columns (without headers), as the Python Data Source yields them.
# Arrow types match Spark's exactly: Spark rejects e.g. int64 for an IntegerType column.
SPARK_KAFKA_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", TIMESTAMP),
        ("timestampType", pa.int32()),
    ]
)

# What a task reads before decoding: those columns, the headers (null unless asked for), and
# Kafka's raw timestamp in milliseconds (``timestamp`` is null where a microsecond timestamp cannot hold it).
READ_SCHEMA = SPARK_KAFKA_SCHEMA.append(pa.field("headers", HEADERS_TYPE)).append(pa.field("timestamp_ms", pa.int64()))


# 10,000 rows: a task holds a batch read, decoded (fastavro's decoder makes a Python dict per record
# first) and conformed at once; at 50,000 each task worker of a 1 M-record Avro run peaked ~80 MiB
# higher (395 against 315 MiB, same run), and the JSON decoder was no faster per record on batches
# of 50,000 (docs/performance.md, "Memory beside the peer").
# Bytes keep large values bounded.
BATCH_ROWS = 10_000
BATCH_BYTES = 32 << 20
# Kafka timestamps (ms) a microsecond int64 can hold.
_MAX_MS = (2**63 - 1) // 1000


class RangeRecords:
    """Iterates the Arrow batches of offsets [start, end) of one partition; afterwards ``reached``
    and ``bytes_read`` say how far the read went and how many key + value bytes it took."""

    def __init__(self, consumer: Consumer, topic: str, partition: int, start: int, end: int,
                 stall_timeout: float, where: str, max_bytes: int | None = None, headers: bool = False):
        self.consumer, self.topic, self.partition = consumer, topic, partition
        self.start, self.end, self.stall_timeout, self.where = start, end, stall_timeout, where
        self.max_bytes, self.headers = max_bytes, headers
        self.reached, self.bytes_read = start, 0
        self._last: tuple[pa.Array, np.ndarray] | None = None  # the last batch yielded: offsets, sizes

    def stop_at(self, offset: int) -> None:
        """The reader of the batches stops before ``offset`` (and leaves the loop): the range was
        read up to it, and the bytes read are those of the records before it."""
        self.reached = offset
        if self._last is not None:
            offsets, sizes = self._last
            self.bytes_read -= int(sizes[offsets.to_numpy() >= offset].sum())
            self._last = None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        pending = _Pending(self.topic, self.partition)
        consumed = 0  # bytes of the records taken from the consumer, yielded or pending
        for messages in read_messages(self.consumer, self.topic, self.partition, self.start, self.end,
                                      self.stall_timeout, self.where):
            chunk = _Chunk.of(messages, self.headers)
            stop = False
            if self.max_bytes is not None:
                # The records up to the one that reaches the budget (at least one).
                reaching = _first_reaching(chunk.sizes, self.max_bytes - consumed)
                if reaching < len(chunk):
                    chunk, stop = chunk.slice(0, reaching + 1), True
            consumed += chunk.bytes
            yield from self._counted(pending.add(chunk))
            if stop:
                self.reached = chunk.offsets[-1].as_py() + 1
                break
        else:
            self.reached = self.end
        if pending.count:
            yield from self._counted([pending.take()])

    def _counted(self, batches: Iterable[tuple[pa.RecordBatch, np.ndarray]]) -> Iterator[pa.RecordBatch]:
        """``bytes_read`` follows the batches as they are yielded, so ``stop_at`` can take back the rest."""
        for batch, sizes in batches:
            self.bytes_read += int(sizes.sum())
            self._last = (batch.column("offset"), sizes)
            yield batch


def _first_reaching(sizes: np.ndarray, budget: int) -> int:
    """The index of the first record whose size, added to those before it, reaches ``budget``
    (``len(sizes)`` when none does)."""
    return int(np.searchsorted(np.cumsum(sizes), budget, side="left"))


@dataclass(frozen=True)
class _Chunk:
    """The fields of a list of messages, copied out at once column by column (``of``): a Python
    loop calling each message's methods cost more than the Kafka client's own work (measured, one
    process reading 1 M records: the reader ran at 0.44 x a raw consume with one, 0.79 x without)."""

    keys: pa.Array
    values: pa.Array
    offsets: pa.Array
    kinds: np.ndarray  # confluent-kafka timestamp types
    stamps: np.ndarray  # ms
    headers: list | None  # per message, a list of (key, value); None when not read
    sizes: np.ndarray  # key + value bytes per message

    @classmethod
    def of(cls, messages: list, headers: bool) -> "_Chunk":
        count = len(messages)
        keys = pa.array(list(map(Message.key, messages)), pa.large_binary())
        values = pa.array(list(map(Message.value, messages)), pa.large_binary())
        stamps = np.fromiter(chain.from_iterable(map(Message.timestamp, messages)), np.int64, 2 * count).reshape(count, 2)
        return cls(keys, values, pa.array(np.fromiter(map(Message.offset, messages), np.int64, count)),
                   stamps[:, 0], stamps[:, 1], [h or [] for h in map(Message.headers, messages)] if headers else None,
                   _lengths(keys) + _lengths(values))

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def bytes(self) -> int:
        return int(self.sizes.sum())

    def slice(self, start: int, stop: int) -> "_Chunk":
        return _Chunk(*(None if (v := getattr(self, f.name)) is None else v[start:stop] for f in fields(self)))


def _lengths(array: pa.Array) -> np.ndarray:
    return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


class _Pending:
    """Chunks read so far, cut into Arrow batches of at most BATCH_ROWS rows or about BATCH_BYTES."""

    def __init__(self, topic: str, partition: int):
        self.topic, self.partition = topic, partition
        self.chunks: list[_Chunk] = []
        self.count = self.bytes = 0

    def add(self, chunk: _Chunk) -> Iterator[tuple[pa.RecordBatch, np.ndarray]]:
        """The batches ``chunk`` fills, with their records' sizes: each ends with the record that
        reaches either bound."""
        start = 0
        while start < len(chunk):
            room = _first_reaching(chunk.sizes[start:], BATCH_BYTES - self.bytes) + 1
            stop = min(start + min(BATCH_ROWS - self.count, room), len(chunk))
            head = chunk.slice(start, stop)
            self.chunks.append(head)
            self.count += len(head)
            self.bytes += head.bytes
            if self.count >= BATCH_ROWS or self.bytes >= BATCH_BYTES:
                yield self.take()
            start = stop

    def take(self) -> tuple[pa.RecordBatch, np.ndarray]:
        chunks, count = self.chunks, self.count
        self.chunks, self.count, self.bytes = [], 0, 0
        kinds, stamps = np.concatenate([c.kinds for c in chunks]), np.concatenate([c.stamps for c in chunks])
        types = np.full(count, -1, np.int32)  # Spark's timestampType; -1 for none (kind 0) or an unknown kind
        types[kinds == 1], types[kinds == 2] = 0, 1
        # No timestamp (kind 0), or one a microsecond int64 cannot hold: null (decode quarantines the latter).
        millis = pa.array(stamps, pa.int64(), mask=kinds == 0)
        holdable = (stamps >= -_MAX_MS) & (stamps <= _MAX_MS) & (kinds != 0)
        micros = pa.array(np.where(holdable, stamps, 0) * 1000, mask=~holdable)
        batch = pa.RecordBatch.from_arrays(
            [
                # Large while a consume() list is held (it may pass 2 GiB); a batch never does.
                pa.concat_arrays([c.keys for c in chunks]).cast(pa.binary()),
                pa.concat_arrays([c.values for c in chunks]).cast(pa.binary()),
                pa.DictionaryArray.from_arrays(np.zeros(count, np.int32), pa.array([self.topic])).cast(pa.string()),
                pa.array(np.full(count, self.partition, np.int32)),
                pa.concat_arrays([c.offsets for c in chunks]),
                micros.cast(TIMESTAMP),
                pa.array(types),
                pa.nulls(count, HEADERS_TYPE) if chunks[0].headers is None else
                pa.array([h for c in chunks for h in c.headers], HEADERS_TYPE),
                millis,
            ],
            schema=READ_SCHEMA,
        )
        return batch, np.concatenate([c.sizes for c in chunks])
